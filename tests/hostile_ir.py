"""A corpus of hostile IR documents (issue 16): each a small mutation of a real build of a
tiny Llama, with a fragment of the message that refuses it.

`hostile_cases(plain, dp)` takes two built documents (a plain build and a `--dp 2 --zero 3`
build, both B=2 T=4) and yields (kind, document or raw text, expected fragment). A case
whose document is a `str` is written as is (files that are not JSON documents at all).
"""

from __future__ import annotations

import copy
import json

TINY = dict(n_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48, vocab_size=64,
            max_seq=64)
SHAPES = {"B": 2, "T": 4}
ENTRY, ATTENTION = "Llama#1", "CausalSelfAttention#1"


def function(document: dict, name: str) -> dict:
    return next(f for f in document["graph"]["functions"] if f["name"] == name)


def node(document: dict, target: str, name: str = ATTENTION) -> dict:
    return next(n for n in function(document, name)["nodes"] if n["target"] == target)


def ops(document: dict, name: str = ENTRY) -> list:
    return document["schedule"]["functions"][name]


def buffered(document: dict, name: str = ENTRY) -> dict:
    return next(op for op in ops(document, name) if op.get("buffers"))


def saved(document: dict, name: str = ENTRY) -> dict:
    return next(op for op in ops(document, name)
                if any(b[1] == "saved_activations" for b in op.get("buffers", ())))


def calls(document: dict):
    return [n for f in document["graph"]["functions"] for n in f["nodes"]
            if n["kind"] == "call"]


def dist(document: dict) -> dict:
    return document["schedule"]["distributed"]


def bucket(document: dict, name: str = "blocks") -> dict:
    return next(b for b in dist(document)["buckets"] if b["name"] == name)


def param(document: dict, name: str, function_name: str = ENTRY) -> dict:
    return next(p for p in function(document, function_name)["params"] if p["name"] == name)


def _set(into: dict, **values):
    into.update(values)


def _swap_first_two(items: list):
    items[0], items[1] = items[1], items[0]


def _recursive(document: dict):
    """The attention calls itself: a runtime would recurse for ever."""
    attention = function(document, ATTENTION)
    attention["nodes"].append({**copy.deepcopy(calls(document)[0]), "id": "f99",
                               "target": ATTENTION, "inputs": ["x"], "outputs": ["%99"]})


def _duplicate_function(document: dict):
    document["graph"]["functions"].append(copy.deepcopy(function(document, ATTENTION)))


def _overlap(document: dict):
    first, second = ops(document)[0]["buffers"][0], ops(document)[1]["buffers"][0]
    second[2] = first[2]


def _exponential_calls(document: dict):
    """60 functions, each calling the next twice: 2^60 runs from a few kilobytes."""
    template = function(document, "SwiGLU_MLP#1")
    chain = [dict(copy.deepcopy(template), name=f"Chain#{i}", gradient_of="",
                  nodes=[{**copy.deepcopy(calls(document)[0]), "id": f"c{i}.{k}",
                          "target": f"Chain#{i + 1}", "repeat": 1} for k in range(2)])
             for i in range(60)]
    document["graph"]["functions"] += chain
    function(document, "SwiGLU_MLP#1")["nodes"].append(
        {**copy.deepcopy(calls(document)[0]), "id": "f99", "target": "Chain#0"})


def _deep_nesting() -> str:
    return "[" * 200_000 + "]" * 200_000


# (kind, change, expected fragment): `change` edits a deep copy of the plain build
PLAIN = [
    # ---------------------------------------------------------------- the document
    ("top level list", lambda d: [d], "top level must be an object"),
    ("missing graph", lambda d: d.pop("graph"), "missing top-level keys: graph"),
    ("missing schedule", lambda d: d.pop("schedule"), "missing top-level keys"),
    ("ir_version 99", lambda d: _set(d, ir_version=99), "ir_version 99"),
    ("ir_version string", lambda d: _set(d, ir_version="1"), "ir_version '1'"),
    ("unknown top-level key", lambda d: _set(d, exec="import os"), "unknown top-level key"),
    ("1 MiB string", lambda d: _set(d["metadata"], model="x" * (2**20 + 1)),
     "a string of 1048577 characters"),
    ("repeat 10**12", lambda d: _set(calls(d)[0], repeat=10**12), "repeat 1000000000000"),
    # ---------------------------------------------------------------- the graph
    ("graph not an object", lambda d: _set(d, graph=[]), "malformed graph"),
    ("unknown node kind", lambda d: _set(node(d, "matmul"), kind="exec"),
     "unknown node kind `exec`"),
    ("unknown primitive", lambda d: _set(node(d, "matmul"), target="os.system"),
     "not a primitive"),
    ("dangling input", lambda d: node(d, "matmul")["inputs"].__setitem__(0, "%999"),
     "used before it is defined"),
    ("value defined twice", lambda d: node(d, "view")["outputs"].__setitem__(0, "%1"),
     "defined twice"),
    ("extra output", lambda d: node(d, "matmul")["outputs"].append("%998"), "returns"),
    ("extra input", lambda d: node(d, "view")["inputs"].append("%1"), "takes 1 input"),
    ("repeat 0", lambda d: _set(calls(d)[0], repeat=0), "positive integer"),
    ("repeat negative", lambda d: _set(calls(d)[0], repeat=-3), "positive integer"),
    ("repeat true", lambda d: _set(calls(d)[0], repeat=True), "positive integer"),
    ("repeat string", lambda d: _set(calls(d)[0], repeat="2"), "positive integer"),
    ("missing callee", lambda d: _set(calls(d)[0], target="Nope#1"),
     "not a function of this graph"),
    ("entry missing", lambda d: _set(d["graph"], entry="Gone#1"), "does not exist"),
    ("backward missing", lambda d: _set(d["graph"], backward="Gone#1.backward"),
     "does not exist"),
    ("duplicate function", _duplicate_function, "duplicate function names"),
    ("function without nodes", lambda d: function(d, ATTENTION).pop("nodes"),
     "malformed graph"),
    ("recursive call", _recursive, "calls itself"),
    ("nested repeats 2**20 x 2**20", lambda d: [c.update(repeat=2**20) for c in calls(d)],
     "function instances, more than the limit"),
    ("2**60 runs through shared calls", _exponential_calls,
     "function instances, more than the limit"),
    ("node id used twice", lambda d: _set(function(d, ATTENTION)["nodes"][1], id="f0"),
     "node id f0 is used twice"),
    ("span not [file, line, column]", lambda d: _set(node(d, "matmul"), span=["x", -1]),
     "`span` must be"),
    ("unknown annotation", lambda d: _set(node(d, "matmul"), annotations=[["exec", ["rm"]]]),
     "unknown annotation `@exec`"),
    ("backward transpose XX", lambda d: next(
        n for n in function(d, ATTENTION + ".backward")["nodes"] if n["target"] == "matmul")
     ["attrs"].update(transpose="XX"), "must be one of NN, NT, TN, TT"),
    ("backward node phase", lambda d: _set(function(d, ATTENTION + ".backward")["nodes"][0],
                                           phase="forward"), "phase `backward`"),
    ("output never defined", lambda d: function(d, ENTRY)["outputs"].__setitem__(0, "%404"),
     "never defined"),
    ("gradient_of missing", lambda d: _set(function(d, ATTENTION + ".backward"),
                                           gradient_of="Gone#1"), "the gradient of `Gone#1`, not a function"),
    ("value shape edited", lambda d: _set(function(d, ATTENTION)["values"][0],
                                          shape=["2", "4", "65"]), "declared"),
    ("value shape negative", lambda d: _set(function(d, ATTENTION)["values"][0],
                                            shape=["2", "-4", "64"]), "dimension"),
    ("value shape zero", lambda d: _set(function(d, ATTENTION)["values"][0],
                                        shape=["2", "0", "64"]), "dimension"),
    ("dtype float128", lambda d: _set(function(d, ATTENTION)["values"][0], dtype="float128"),
     "float128"),
    ("input dtype float128", lambda d: _set(function(d, ENTRY)["inputs"][0], dtype="float128"),
     "float128"),
    ("param shape code", lambda d: _set(param(d, "embedding"), shape=["__import__('os')", "32"]),
     "__import__"),
    ("param shape -256", lambda d: _set(param(d, "embedding"), shape=["-256", "32"]),
     "-256"),
    ("param shape 2**50", lambda d: _set(param(d, "embedding"), shape=[str(2**50), "32"]),
     str(2**50)),
    ("param dtype int64", lambda d: _set(param(d, "embedding"), dtype="int64"), "int64"),
    ("transpose XX", lambda d: node(d, "matmul")["attrs"].update(transpose="XX"), "XX"),
    ("transpose flipped", lambda d: node(d, "matmul")["attrs"].update(transpose="NN"),
     "another transpose mode would fit"),
    ("split sizes 5+2+2", lambda d: node(d, "split")["attrs"].update(sizes=[5, 2, 2]),
     "split"),
    ("split sizes negative", lambda d: node(d, "split")["attrs"].update(sizes=[6, -2, 4]),
     "split"),
    ("split dim 9", lambda d: node(d, "split")["attrs"].update(dim=9), "dim"),
    ("view wrong size", lambda d: node(d, "view")["attrs"].update(shape=[2, 4, 8, 9]),
     "view"),
    ("transpose dim 7", lambda d: node(d, "transpose")["attrs"].update(dim1=7), "dim"),
    ("attrs not an object", lambda d: _set(node(d, "matmul"), attrs=["transpose"]),
     "malformed graph"),
    ("inputs a string", lambda d: _set(node(d, "view"), inputs="%1"), "input"),
    ("alpha nan", lambda d: node(d, "matmul")["attrs"].update(alpha=float("nan")),
     "alpha"),
    ("causal string", lambda d: node(d, "flash_attention")["attrs"].update(causal="yes"),
     "causal"),
    ("phase sideways", lambda d: _set(node(d, "matmul"), phase="sideways"), "phase"),
    ("backward reads a foreign value", lambda d: function(d, ATTENTION + ".backward")["nodes"]
     [0]["inputs"].__setitem__(0, "%777"), "used before it is defined"),
    # ---------------------------------------------------------------- the schedule
    ("empty schedule", lambda d: d["schedule"]["functions"].clear(), "has no schedule"),
    ("schedule not an object", lambda d: _set(d, schedule=[]), "expected an object"),
    ("function left out of the schedule", lambda d: d["schedule"]["functions"].pop(ATTENTION),
     ATTENTION),
    ("scheduled function not in the graph",
     lambda d: d["schedule"]["functions"].update({"Ghost#1": []}), "Ghost#1"),
    ("schedule op of unknown kind", lambda d: _set(ops(d)[0], kind="teleport"),
     "unknown kind"),
    ("schedule op for a missing node", lambda d: _set(ops(d)[0], node="f404"), "f404"),
    ("schedule ops out of order", lambda d: _swap_first_two(ops(d)), "order"),
    ("schedule op dropped", lambda d: ops(d).pop(0), "f0"),
    ("kernel not a string", lambda d: _set(ops(d)[0], kernel=5), "`kernel` must be a string"),
    ("stream a string", lambda d: _set(ops(d)[0], stream="x"), "`stream` must be an integer"),
    ("stream 99", lambda d: _set(ops(d)[0], stream=99), "stream 99"),
    ("negative offset", lambda d: buffered(d)["buffers"][0].__setitem__(2, -256),
     "`buffers` must be"),
    ("overlapping buffers", _overlap, "overlap"),
    ("10**18-byte buffer", lambda d: buffered(d)["buffers"][0].__setitem__(3, 10**18),
     "bytes"),
    ("buffer past its saved record", lambda d: saved(d)["buffers"][0].__setitem__(2, 4096),
     "ends past the 1280-byte record"),
    ("buffer past any plan", lambda d: buffered(d)["buffers"][0].__setitem__(2, 2**50),
     "ends past 70368744177664 bytes"),
    ("buffer of an unknown value", lambda d: buffered(d)["buffers"][0].__setitem__(0, "%555"),
     "%555"),
    ("buffer in an unknown region", lambda d: buffered(d)["buffers"][0].__setitem__(1, "heap"),
     "heap"),
    ("order not a list", lambda d: _set(d["schedule"], order="Llama#1"),
     "`order` must be a list"),
    ("order names a ghost", lambda d: d["schedule"]["order"].append("Ghost#1"), "Ghost#1"),
    ("layout not a list", lambda d: _set(d["schedule"]["layout"], functions={}),
     "`functions` must be a list"),
    ("layout saved overlap", lambda d: d["schedule"]["layout"]["functions"][1]["saved"]
     .update(base=0), "overlap"),
    ("layout negative stride", lambda d: d["schedule"]["layout"]["functions"][0]["saved"]
     .update(stride=-1024), "non-negative integers"),
    ("layout value at a negative offset", lambda d: d["schedule"]["layout"]["functions"][0]
     ["values"][0].update(offset=-64), "non-negative integers"),
    ("layout host record of 10**15 bytes", lambda d: d["schedule"]["layout"]["functions"][0]
     ["host"].update(stride=10**15), "host record ends at"),
    ("layout record of 10**15 bytes", lambda d: d["schedule"]["layout"]["functions"][2]
     ["saved"].update(base=10**15), "past 70368744177664"),
    # ---------------------------------------------------------------- schemas and metadata
    ("weight_schema not a list", lambda d: _set(d, weight_schema={}), "weight_schema"),
    ("weight for an unknown parameter", lambda d: _set(d["weight_schema"][0], param="ghost"),
     "ghost"),
    ("weight shape not the parameter's", lambda d: _set(d["weight_schema"][0], shape=[65, 32]),
     "weight_schema"),
    ("weight stack count 10**12", lambda d: _set(d["weight_schema"][1]["stacks"][0],
                                                 count=10**12), "weight_schema"),
    ("weight kind exec", lambda d: _set(d["weight_schema"][0], kind="exec"), "exec"),
    ("metadata input shape", lambda d: _set(d["metadata"]["inputs"][0], shape=["2", "5"]),
     "metadata"),
    ("metadata input dtype float128", lambda d: _set(d["metadata"]["inputs"][0],
                                                     dtype="float128"), "float128"),
    ("metadata without inputs", lambda d: d["metadata"].pop("inputs"), "metadata"),
    ("training freezes a ghost", lambda d: _set(d["metadata"], training={
        "frozen": ["ghost"], "parameters": {}}), "`training.frozen` is"),
    ("training settings for a ghost", lambda d: _set(d["metadata"], training={
        "frozen": [], "parameters": {"ghost": {"lr_multiplier": 2.0}}}), "names `ghost`"),
    ("training setting nan", lambda d: _set(d["metadata"], training={
        "frozen": [], "parameters": {"embedding": {"lr_multiplier": float("nan")}}}),
     "finite numbers"),
    ("config_schema not an object", lambda d: _set(d, config_schema="x"), "config_schema"),
]

DP = [
    ("distributed not an object", lambda d: d["schedule"].update(distributed=[]), "distributed"),
    ("mesh dp 0", lambda d: dist(d)["mesh"].update(dp=0), "dp"),
    ("shard not numel / dp", lambda d: _set(bucket(d), shard=5), "shard"),
    ("bucket numel huge", lambda d: _set(bucket(d), numel=10**18), "numel"),
    ("bucket params overlap", lambda d: _set(bucket(d)["params"][1], offset=0), "overlap"),
    ("bucket param unknown", lambda d: _set(bucket(d)["params"][0], name="ghost.weight"),
     "ghost.weight"),
    ("collective of unknown kind", lambda d: _set(dist(d)["ops"][2], kind="exec"), "exec"),
    ("event waited, never recorded", lambda d: dist(d)["ops"].pop(0), "step_start"),
    ("collective on stream 7", lambda d: _set(dist(d)["ops"][2], stream=7), "stream"),
    ("collective on an unknown trigger", lambda d: _set(dist(d)["ops"][2], on="whenever"),
     "whenever"),
]

RAW = [
    ("not JSON", lambda: "{not json", "not a JSON document"),
    ("deep JSON", _deep_nesting, "nested too deeply"),
    ("NUL bytes", lambda: "\x00" * 64, "not a JSON document"),
]


def hostile_cases(plain: dict, dp: dict):
    for kind, make, expected in RAW:
        yield kind, make(), expected
    for kind, change, expected in PLAIN:
        yield kind, _changed(plain, change), expected
    for kind, change, expected in DP:
        yield kind, _changed(dp, change), expected


def _changed(document: dict, change):
    document = copy.deepcopy(document)
    result = change(document)
    return result if isinstance(result, list) and result and result[0] is document else document


def text(document) -> str:
    return document if isinstance(document, str) else json.dumps(document)
