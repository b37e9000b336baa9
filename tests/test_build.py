"""`modulec build`, the Graph IR with its derived backward, and `modulec ir verify`."""

import copy
import json
import re

import pytest
from click.testing import CliRunner

from modulec.cli.build_cmd import verify_document
from modulec.cli.main import modulec
from modulec.ir.serialize import dumps
from modulec.lower.build import BuildRequest, build
from modulec.paths import REPO_DIR

MODELS = ["llama", "qwen3", "mistral", "mixtral"]
SHAPES = {"B": 2, "T": 16}


def built(name: str, **settings):
    request = BuildRequest(REPO_DIR / "std" / "models" / f"{name}.module", shapes=SHAPES,
                           settings={k: str(v) for k, v in settings.items()})
    result = build(request)
    assert result.document is not None, [d.message for d in result.diagnostics]
    return result


@pytest.mark.parametrize("name", MODELS)
def test_std_models_build_and_verify(name, tmp_path):
    result = built(name)
    path = tmp_path / f"{name}.ir"
    path.write_text(dumps(result.document))
    assert verify_document(path) == []
    assert set(result.document) == {"ir_version", "graph", "schedule", "weight_schema",
                                    "config_schema", "metadata"}


def test_builds_are_byte_identical():
    assert dumps(built("llama").document) == dumps(built("llama").document)


def test_layers_do_not_multiply_the_ir():
    small, large = built("llama", n_layers=2), built("llama", n_layers=80)
    assert len(small.graph.functions) == len(large.graph.functions)
    calls = [n for f in large.graph.functions for n in f.nodes if n.repeat == 80]
    assert len(calls) == 2  # the stack, forward and backward


def test_derived_backward_reaches_every_trainable_parameter():
    graph = built("llama").graph
    for function in graph.functions:
        if function.gradient_of:
            forward = graph.function(function.gradient_of)
            own = {p.id[len("param:"):] for p in forward.params}
            assert own == {name for name, _ in function.param_grads}, function.name


def test_tied_embedding_gradient_accumulates():
    graph = built("qwen3", tie_word_embeddings="true").graph
    backward = graph.function(graph.backward)
    (embedding,) = [g for p, g in backward.param_grads if p == "embedding"]
    adds = [n for n in backward.nodes if n.target == "add" and embedding in n.outputs]
    assert adds, "the head's and the lookup's gradients of a tied embedding are summed"


def test_cli_build_set_shape_and_emit(tmp_path):
    out = tmp_path / "m.ir"
    result = CliRunner().invoke(modulec, ["build", str(REPO_DIR / "examples" / "llama.module"),
                                          "-o", str(out), "--shape", "B=1", "--shape", "T=8",
                                          "--set", "n_layers=2", "--emit", "graph"])
    assert result.exit_code == 0, result.output
    assert "call DenseTransformerBlock#1" in result.stdout and " x2" in result.stdout
    assert json.loads(out.read_text())["metadata"]["inputs"][0]["shape"] == ["1", "8"]


def test_cli_build_emit_schedule_lists_every_op_with_its_kernel():
    result = CliRunner().invoke(modulec, ["build", str(REPO_DIR / "examples" / "llama.module"),
                                          "--set", "n_layers=3", "--emit", "schedule"])
    assert result.exit_code == 0, result.output
    document = build(BuildRequest(REPO_DIR / "examples" / "llama.module",
                                  settings={"n_layers": "3"})).document
    for name, ops in document["schedule"]["functions"].items():
        plural = "s" if len(ops) != 1 else ""
        assert f"schedule @{name} ({len(ops)} op{plural}) {{" in result.stdout
    assert "call:DenseTransformerBlock#1  ×3" in result.stdout
    assert result.stdout.index("@TinyLlama#1 ") < result.stdout.index("@TinyLlama#1.backward")


def test_schedule_ops_carry_their_planned_buffers():
    from modulec.plan.from_graph import plan_step

    result = built("llama", n_layers="2")
    step = plan_step(result.graph)
    placed = 0
    for name, ops in result.document["schedule"]["functions"].items():
        arenas = {r["region"]: r["arena_bytes"] for r in step.functions[name]["regions"]}
        for op in ops:
            for value, region, offset, size, *_ in op.get("buffers", ()):
                if region == "result":  # in the caller's bytes: its position there
                    assert step.handed[name][value] == offset
                    continue
                assert 0 <= offset and offset + size <= arenas[region], (name, op, value)
                placed += 1
    assert placed > 50


def test_schedule_without_sizes_has_no_buffers():
    document = build(BuildRequest(REPO_DIR / "examples" / "llama.module")).document
    assert not any("buffers" in op for ops in document["schedule"]["functions"].values()
                   for op in ops)


@pytest.mark.parametrize("argument, message", [
    ("d_modl=4096", "did you mean `d_model`"),
    ("d_model=-4", "not a usable size"),
    # a value of the wrong kind for a parameter the build never reads was accepted silently
    ("eps=inf", "`--set eps`: `eps` is inf: a float parameter must be a finite number"),
    ("tie_word_embeddings=1", "`tie_word_embeddings` is declared bool, given 1"),
    ("eps=1e999", "`eps` is inf: a float parameter must be a finite number"),
])
def test_bad_settings_fail_fast(argument, message):
    result = CliRunner().invoke(modulec, ["build", str(REPO_DIR / "std/models/llama.module"),
                                          "--set", argument])
    assert result.exit_code == 1 and message in result.stderr


SETTINGS_MODEL = """model M(n: int = 4, k: int? = 0, eps: float = 1e-5, flag: bool = false):
  forward:
    in: x: [B, n]
    out: y: [B, n]
    graph:
      x -> relu() -> y
"""


@pytest.mark.parametrize("argument, message", [
    # a value that did not evaluate was reported twice, the second time as "given None"
    ("n=", "`--set n=`: no value"),
    ("n=0x10", "`--set n=0x10`: numbers are decimal: write `16`"),
    ("n=10**10**10", "not a compile-time value (`10 ** 10 ** 10` is an integer of more than"),
    ("n=5 6", "`--set n=5 6`: not an expression (unexpected `6`)"),
    ("n=5\n6", "`--set n=5\\n6`: a value is one line"),  # the `6` line was ignored
    ("n=5 # 6", "a comment (`#`) is not part of a value"),  # the comment was ignored
    ("n=-10**20", "`n = -100,000,000,000,000,000,000` is not a usable size"),
    ("n=10**20", "`n = 100,000,000,000,000,000,000` is not a usable size"),
    ("n=1099511627777", "at most 1,099,511,627,776"),
    ("n=1e3", "given 1000.0\n  |\n  = help: an int is a whole number (`32`, `4 * 1024`): write "
     "`1000`"),
    ("n=5.0", "write `5`; `1e3` and `5.0` are floats"),
    ("n=[1, 2]", "`n` is declared int, given [1, 2]"),  # it showed `(Dim(1), Dim(2))`
    ("flag=True", "given True\n  |\n  = help: a bool is `true` or `false` (lowercase)"),
    ("flag=1", "`flag` is declared bool, given 1"),
    ("eps=nan", "`eps` is nan: a float parameter must be a finite number"),
    ("eps=-inf", "`eps` is -inf: a float parameter must be a finite number"),  # was E003 twice
    # an `int?` past int64 was E027 at the declaration's default, not at `--set`
    ("k=-10**20", "`--set k`: `k = -100,000,000,000,000,000,000` is not a usable integer"),
])
def test_set_value_spellings_refused(argument, message, tmp_path):
    path = tmp_path / "m.module"
    path.write_text(SETTINGS_MODEL)
    result = CliRunner().invoke(modulec, ["build", str(path), "--shape", "B=2", "--set",
                                          argument, "-o", str(tmp_path / "m.ir")])
    assert result.exit_code == 1 and message in result.stderr, result.output
    assert result.stderr.count("error[") == 1 and "None" not in result.stderr


@pytest.mark.parametrize("argument, value", [
    ("n=1_000", "1000"), ("n=+5", "5"), ("n= 5 ", "5"), ("n=2 * 3", "6"), ("n=7 // 2", "3"),
    ("k=-3", "-3"), ("flag=true", "True"), ("eps=5", "5"),
])
def test_set_value_spellings_accepted(argument, value, tmp_path):
    """`--set` reads one compile-time expression, as a default is written in a module."""
    path = tmp_path / "m.module"
    path.write_text(SETTINGS_MODEL)
    result = CliRunner().invoke(modulec, ["build", str(path), "--shape", "B=2", "--set",
                                          argument, "-o", str(tmp_path / "m.ir")])
    assert result.exit_code == 0, result.output
    name = argument.partition("=")[0]
    document = json.loads((tmp_path / "m.ir").read_text())
    assert document["metadata"]["parameters"][name] == value


@pytest.mark.parametrize("field, message", [
    ('"hidden_size": 1e3', "given 1000.0\n  |\n  = help: an int is a whole number (`32`, "
     "`4 * 1024`): write `1000`"),
    ('"hidden_size": -1e20', "given -1e+20\n  |\n  = help: an int is a whole number (`32`, "
     "`4 * 1024`)\n"),  # no "write `-100000000000000000000`": no size either
    ('"hidden_size": {"a": 1}', "`n` is declared int, given a JSON object"),  # was {'a': 1}
    ('"rms_norm_eps": -Infinity', "`eps` is -inf: a float parameter must be a finite number"),
    ('"pad_token_id": -100000000000000000000', "`pad = -100,000,000,000,000,000,000` is "
     "not a usable integer"),  # an int? past int64: E027 at the declaration's default
])
def test_config_value_spellings_refused(field, message, tmp_path):
    path, config = tmp_path / "m.module", tmp_path / "config.json"
    path.write_text("model M(n: int = 4, eps: float = 1e-5, pad: int? = 0):\n  hf_config:\n"
                    "    param_mapping:\n      n: hidden_size\n      eps: rms_norm_eps\n"
                    "      pad: pad_token_id\n" + SETTINGS_MODEL.split(":\n", 1)[1])
    config.write_text("{" + field + "}")
    result = CliRunner().invoke(modulec, ["build", str(path), "--shape", "B=2", "--config",
                                          str(config), "-o", str(tmp_path / "m.ir")])
    assert result.exit_code == 1 and message in result.stderr, result.output
    assert result.stderr.count("error[") == 1


@pytest.mark.parametrize("option", ["--set", "--shape"])
def test_a_name_given_twice_takes_the_last_value_and_says_so(option, tmp_path):
    """`--set n=5 --set n=6` builds with n = 6, as a repeated option does (a script's base
    settings and an override), and a note names the value used."""
    path = tmp_path / "m.module"
    path.write_text(SETTINGS_MODEL)
    name = "n" if option == "--set" else "B"
    out = tmp_path / "m.ir"
    result = CliRunner().invoke(modulec, ["build", str(path), "--shape", "B=2", option,
                                          f"{name}=5", option, f"{name}=6", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"{option} `{name}` is given more than once; the last value, `6`, is used" \
        in result.output
    once = tmp_path / "once.ir"  # builds are byte-identical: the same as given once
    given = ["--shape", "B=6"] if option == "--shape" else ["--shape", "B=2", "--set", "n=6"]
    assert CliRunner().invoke(modulec, ["build", str(path), *given, "-o",
                                        str(once)]).exit_code == 0
    assert out.read_bytes() == once.read_bytes()


def test_hf_config_null_field_keeps_the_default(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 256, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "intermediate_size": 512, "vocab_size": 1000,
                                  "max_position_embeddings": None, "rms_norm_eps": 1e-6}))
    result = build(BuildRequest(REPO_DIR / "std/models/llama.module", config=config,
                                shapes=SHAPES))
    assert result.document["metadata"]["parameters"]["d_model"] == "256"
    assert any("max_position_embeddings` is null" in n for n in result.notices)


@pytest.mark.parametrize("text, kind", [("[1, 2]", "list"), ("7", "int")])
def test_hf_config_that_is_not_an_object_is_an_error(tmp_path, text, kind):
    config = tmp_path / "config.json"
    config.write_text(text)
    result = CliRunner().invoke(modulec, ["build", str(REPO_DIR / "std/models/llama.module"),
                                          "--config", str(config)])
    assert result.exit_code == 1, result.output
    assert f"is a JSON {kind}, not an object" in result.stderr
    assert "bug in modulec" not in result.output


# ====================================================================== hostile IR
def _first_function(document):
    return next(f for f in document["graph"]["functions"] if f["nodes"])


def _calls(document) -> list[dict]:
    return [n for f in document["graph"]["functions"] for n in f["nodes"] if n["kind"] == "call"]


# (case, its edit of a good document, what the refusal says). The good document is built
# once per run, by the fixture below: built here, at collection, it cost every pytest
# worker four builds of llama (the ids and the cases of two parametrizations).
BROKEN = [
    ("missing key", lambda d: d.pop("schedule"), "missing top-level keys"),
    ("version", lambda d: d.update(ir_version=99), "ir_version"),
    ("dangling input", lambda d: _first_function(d)["nodes"][0]["inputs"].__setitem__(0, "%999"), "used before it is defined"),
    ("unknown op", lambda d: _first_function(d)["nodes"][0].update(target="warp"), "not a primitive"),
    ("arity", lambda d: _first_function(d)["nodes"][0]["outputs"].append("%998"), "returns"),
    ("defined twice", lambda d: _first_function(d)["nodes"][1]["outputs"].__setitem__(0, _first_function(d)["nodes"][0]["outputs"][0]), "defined twice"),
    ("repeat", lambda d: [n.update(repeat=0) for n in _calls(d)], "positive integer"),
    ("callee", lambda d: [n.update(target="Nope#1") for n in _calls(d)], "not a function of this graph"),
    ("malformed", lambda d: d["graph"]["functions"][0].pop("nodes"), "malformed graph"),
    ("entry", lambda d: d["graph"].update(entry="Gone#1"), "does not exist"),
]


@pytest.fixture(scope="module")
def good_document() -> dict:
    document = built("llama", n_layers=2).document
    assert document["graph"]["functions"][-1]  # the document is not empty
    return document


def _broken(good: dict, change) -> dict:
    document = copy.deepcopy(good)
    change(document)
    return document


@pytest.mark.parametrize("case, change, message", BROKEN, ids=[c[0] for c in BROKEN])
def test_verify_rejects_broken_ir(tmp_path, good_document, case, change, message):
    path = tmp_path / "broken.ir"
    path.write_text(json.dumps(_broken(good_document, change)))
    problems = verify_document(path)
    assert problems and any(message in p for p in problems), problems


@pytest.mark.parametrize("case, change, message", BROKEN, ids=[c[0] for c in BROKEN])
def test_run_loader_refuses_what_verify_refuses(good_document, case, change, message):
    from runtime.errors import RuntimeUserError
    from runtime.program import program_from_document

    document = _broken(good_document, change)
    with pytest.raises(RuntimeUserError) as refused:  # before any tensor is made
        program_from_document(document)
    assert message in str(refused.value) or message in " ".join(refused.value.help)


def test_verify_refuses_deep_json(tmp_path):
    path = tmp_path / "deep.ir"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert any("nested too deeply" in p for p in verify_document(path))


def test_loader_size_limits():
    from modulec.ir.load import check_document

    good = built("llama", n_layers=2).document
    long = copy.deepcopy(good)
    long["metadata"]["note"] = "a" * (2**20 + 1)
    assert "a string of" in check_document(long)[0]
    many = copy.deepcopy(good)
    for function in many["graph"]["functions"]:
        for node in function["nodes"]:
            if node["kind"] == "call":
                node["repeat"] = 10**12
    assert "more than the limit" in check_document(many)[0]


def test_verify_rejects_non_json(tmp_path):
    path = tmp_path / "x.ir"
    path.write_text("{not json")
    result = CliRunner().invoke(modulec, ["ir", "verify", str(path)])
    assert result.exit_code == 1 and "not a JSON document" in result.stderr
    assert "Traceback" not in result.output


# ====================================================================== hand-edited types
def _function(document, name):
    return next(f for f in document["graph"]["functions"] if f["name"] == name)


def _value(function, value_id):
    return next(v for v in function["values"] + function["inputs"] if v["id"] == value_id)


ATTENTION, MLP = "CausalSelfAttention#1", "SwiGLU_MLP#1"


def _set_input(name, node, inputs):
    return lambda d: _function(d, name)["nodes"][node].update(inputs=inputs)


def _set_attr(name, node, attr, value):
    return lambda d: _function(d, name)["nodes"][node]["attrs"].update({attr: value})


def _set_type(name, value, **changes):
    def edit(document):
        info = _value(_function(document, name), value)
        for key, change in changes.items():
            info[key] = change(info[key]) if callable(change) else change
    return edit


def _set_buffer(name, op, item, value):
    return lambda d: d["schedule"]["functions"][name][op]["buffers"][0].__setitem__(item, value)


def _offset_of(name, op):
    return lambda d: d["schedule"]["functions"][name][op]["buffers"][0][2]


# Each document keeps its structure and lies about its types or its buffers; before issue
# 15 `ir verify` checked structure only and called every one of them valid.
TYPE_EDITS = [
    ("flipped matmul mode", _set_attr(ATTENTION, 0, "transpose", "NN"),
     "`matmul(transpose=NN)` contracts"),
    ("unknown matmul mode", _set_attr(ATTENTION, 0, "transpose", "XX"),
     "must be one of NN, NT, TN, TT"),
    ("edited shape", _set_type(ATTENTION, "%1", shape=lambda s: s[:-1] + ["12289"]),
     "`%1` is declared [2, 16, 12289, bf16], but matmul(transpose=NT) gives [2, 16, 12288"),
    ("missing operand", _set_input(ATTENTION, 0, ["x"]), "needs its input `B`"),
    ("wrong dtype", _set_type(ATTENTION, "%1", dtype="fp32"), "`%1` is declared"),
    ("int where floats go", _set_type("Llama#1", "token_ids", dtype="bf16"),
     "`indices` must be int32, found bf16"),
    ("statistics dtype", _set_type(ATTENTION, "%12", dtype="bf16"),
     "but flash_attention gives [2, 32, 16, fp32]"),
    ("no such dtype", _set_type(ATTENTION, "%1", dtype="float128"), "has dtype `float128`"),
    ("not a dimension", _set_type(ATTENTION, "%1", shape=["__import__('os')", "16", "12288"]),
     "is not a dimension"),
    ("gradient shape", _set_type(f"{ATTENTION}.backward", "%b16", shape=["4096", "12288"]),
     "`%b16` is declared [4096, 12288, bf16]"),
    ("negative dim", _set_type("Llama#1", "token_ids", shape=["-256", "16"]),
     "has a negative dimension"),
    ("boolean repeat", lambda d: _function(d, "Llama#1")["nodes"][2].update(repeat=True),
     "repeat must be a positive integer, not True"),
    ("call result shape", _set_type("DenseTransformerBlock#1", "%4",
                                    shape=["2", "16", "4097"]),
     f"but call {ATTENTION} gives [2, 16, 4096, bf16]"),
]


def _overlapping(document):
    """The MLP backward's hidden (node 1's third output: the activation's backward returns
    it, the down weight's gradient reads it at node 2) moved onto d_gate's bytes (node 1's
    first output, read by the concat at node 3): both are live from node 1 on. Since the
    MLP saves gate/up (6a3f3aa) its forward has one transient value only, the activation
    output, and the up projection it was moved onto before is a saved value (another
    region), so the forward no longer holds two values that could overlap."""
    backward = f"{MLP}.backward"
    op = document["schedule"]["functions"][backward][1]
    assert [b[0] for b in op["buffers"]] == ["%b2", "%b3", "%b4"]  # d_gate, d_up, hidden
    op["buffers"][2][2] = op["buffers"][0][2]


def _swapped(document):
    ops = document["schedule"]["functions"][ATTENTION]
    ops[0], ops[1] = ops[1], ops[0]


SCHEDULE_EDITS = [
    ("overlapping live buffers", _overlapping, "overlap in transient_activations"),
    ("buffer too small", _set_buffer(ATTENTION, 0, 3, 100), "the value needs"),
    ("buffer past its record", _set_buffer(ATTENTION, 0, 2, 10**9), "ends past the"),
    ("nodes out of order", _swapped, "each node once, in order"),
    ("repeat changed", lambda d: d["schedule"]["functions"]["Llama#1"][2].update(repeat=1),
     "repeat 1, the node's is 2"),
]


@pytest.fixture(scope="module")
def two_layers():
    return built("llama", n_layers=2).document


@pytest.mark.parametrize("case, edit, message", TYPE_EDITS + SCHEDULE_EDITS,
                         ids=[c[0] for c in TYPE_EDITS + SCHEDULE_EDITS])
def test_verify_rederives_types_and_buffers(tmp_path, two_layers, case, edit, message):
    document = copy.deepcopy(two_layers)
    edit(document)
    path = tmp_path / "edited.ir"
    path.write_text(json.dumps(document))
    problems = verify_document(path)
    assert problems and any(message in p for p in problems), problems


def test_verify_reports_the_first_wrong_node_with_the_ir_around_it(tmp_path, two_layers):
    document = copy.deepcopy(two_layers)
    _set_type(ATTENTION, "%1", shape=["2", "16", "12289"])(document)
    path = tmp_path / "edited.ir"
    path.write_text(json.dumps(document))
    result = CliRunner().invoke(modulec, ["ir", "verify", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    # one report, at the matmul: the view reading %1 next is checked against the derived type
    assert result.stderr.count("error:") == 1, result.stderr
    assert f"in `{ATTENTION}`, node f0:" in result.stderr
    assert "  > f0: %1: [2, 16, 12289, bf16] = op matmul(" in result.stderr
    assert "    f1: %2: " in result.stderr  # the lines after it, as check_jaxpr prints


@pytest.mark.parametrize("path", sorted((REPO_DIR / "examples").glob("*.module")),
                         ids=lambda p: p.stem)
def test_examples_build_and_verify(tmp_path, path):
    result = build(BuildRequest(path, shapes={"B": 1, "T": 16}))
    assert result.document is not None, [d.message for d in result.diagnostics]
    out = tmp_path / "x.ir"
    out.write_text(dumps(result.document))
    assert verify_document(out) == []


def test_written_backward_is_kept_as_written(tmp_path):
    source = tmp_path / "m.module"
    source.write_text(
        "module Lin(d: int, f: int):\n  params:\n    w: [f, d]\n  forward:\n    in: x: [B, d]\n"
        "    out: [B, f]\n    graph:\n      (x, w) -> matmul(transpose=NT) -> out\n    save: [x]\n"
        "  backward:\n    graph:\n      (d_out, w) -> matmul(transpose=NN) -> d_x\n"
        "      (d_out, saved.x) -> matmul(transpose=TN) -> d_w\n\n"
        "model M(d: int = 8, f: int = 16):\n  params:\n    lin: Lin(d, f)\n  forward:\n"
        "    in: x: [B, d]\n    out: [B, f]\n    graph:\n      x -> lin -> out\n")
    graph = build(BuildRequest(source, shapes={"B": 2})).graph
    written = graph.function("Lin#1.backward")
    assert [n.target for n in written.nodes] == ["matmul", "matmul"]  # not matmul_backward
    assert written.saved == ("x",) and dict(written.param_grads) == {"w": "%b2"}
    assert written.outputs == ("%b1",)


def test_split_backward_reads_the_gradients_of_every_part():
    # the derived backward (the source writes CausalSelfAttention's, with a concat)
    request = BuildRequest(REPO_DIR / "std" / "models" / "llama.module", shapes=SHAPES,
                           derive_written=True)
    attention = build(request).graph.function("CausalSelfAttention#1.backward")
    (node,) = [n for n in attention.nodes if n.target == "split_backward"]
    assert len(node.inputs) == 3 and all(node.inputs)  # q, k and v gradients


def test_the_written_attention_backward_concatenates_the_head_gradients():
    attention = built("llama").graph.function("CausalSelfAttention#1.backward")
    (node,) = [n for n in attention.nodes if n.target == "concat"]
    assert len(node.inputs) == 3 and not any(n.target.endswith("_backward") and
                                             n.target.startswith("split") for n in attention.nodes)


def _chain(length: int):
    """A function of `length` silu ops in a row, every output in one of two 8-byte slots."""
    from modulec.ir.graph import Function, Graph, Node, ValueInfo

    values, nodes, ops, previous = [], [], [], "x"
    for i in range(length):
        value = f"%{i + 1}"
        values.append(ValueInfo(value, ("4", "B"), "bf16"))
        nodes.append(Node(f"f{i}", "op", "silu", (previous,), (value,)))
        ops.append({"node": f"f{i}", "kernel": "kernels.silu", "phase": "forward",
                    "repeat": 1, "stream": 0,
                    "buffers": [[value, "transient_activations", (i % 2) * 8, 8]]})
        previous = value
    function = Function("Chain#1", "Chain", "Chain", (), (), (ValueInfo("x", ("4", "B"), "bf16"),),
                        (previous,), tuple(values), tuple(nodes))
    return Graph("Chain", "Chain#1", "", (function,)), {"functions": {"Chain#1": ops},
                                                         "order": ["Chain#1"]}


def test_verify_is_linear_in_the_ir():
    """A check that compares all pairs (or scans a function per value) is quadratic:
    4x the ops would take 16x the time. Best of three runs each with the garbage collector
    paused (a full collection inside the larger run is not the verifier's cost), and a
    margin of 10x (it failed at 8x on two loaded cores: 9.5x); quadratic stays out of it."""
    import gc
    import time

    from modulec.ir.verify import verify_graph
    from modulec.ir.verify_schedule import verify_schedule

    def seconds(length: int) -> float:
        graph, schedule = _chain(length)
        best = float("inf")
        gc.disable()
        try:
            for _ in range(3):
                start = time.perf_counter()
                assert verify_graph(graph) == [] and verify_schedule(schedule, graph) == []
                best = min(best, time.perf_counter() - start)
        finally:
            gc.enable()
        return best

    seconds(100)  # the op table loaded
    assert seconds(16000) < 10 * seconds(4000) + 0.05


def _declarations(*folders):
    from modulec.syntax.parser import parse_file

    for folder in folders:
        for path in sorted((REPO_DIR / folder).glob("*.module")):
            for decl in parse_file(path).program.decls:
                if decl.kind in ("module", "block") and not decl.abstract:
                    yield path, decl.name


@pytest.mark.parametrize("path, name", list(_declarations("std/modules", "std/blocks")),
                         ids=lambda item: getattr(item, "stem", item))
@pytest.mark.parametrize("derive", [False, True], ids=["written", "derived"])
def test_every_std_declaration_built_alone_verifies(path, name, derive):
    """Built alone (as --verify-backward does), a module keeps symbolic parameters whose
    constraints (`num_heads % num_kv_heads == 0`) the IR does not carry: the verifier
    decides what involves them by algebra only, never by sampling."""
    result = build(BuildRequest(path, model=name, shapes={"B": 2, "T": 4},
                                derive_written=derive))
    assert result.document is not None, [d.message for d in result.diagnostics]


def test_a_declared_but_uncalled_module_is_left_out_of_the_weight_schema(tmp_path):
    """A module parameter the forward never calls has no function in the graph, so its
    weights have nothing to load into: the weight schema named them anyway, and `ir
    verify` refused the build's own document (found by the soundness test's mutants)."""
    path = tmp_path / "unused.module"
    path.write_text("module Inner(d: int):\n  params:\n    w: [d, d]\n  forward:\n"
                    "    in: x: [B, d]\n    out: y: [B, d]\n    graph:\n"
                    "      x -> matmul(w, transpose=NT) -> y\n\n"
                    "model U(d: int = 4):\n  params:\n    w: [d, d]\n    inner: Inner(d)\n"
                    "  forward:\n    in: x: [B, d]\n    out: y: [B, d]\n    graph:\n"
                    "      x -> matmul(w, transpose=NT) -> y\n"
                    "  hf_mapping:\n    w: \"w\"\n    inner.w: \"inner.w\"\n",
                    encoding="utf-8")
    result = build(BuildRequest(path, shapes={"B": 2}))
    assert result.document is not None, result.diagnostics
    assert [e["param"] for e in result.document["weight_schema"]] == ["w"]
    out = tmp_path / "u.ir"
    out.write_text(dumps(result.document), encoding="utf-8")
    assert CliRunner().invoke(modulec, ["ir", "verify", str(out)]).exit_code == 0


def test_a_size_past_the_limit_inside_a_library_module_is_e027_at_build(tmp_path):
    """Found by the fuzz run (seed 2): with Mixtral's `d_ff` default at 10^26, check
    passed and build dropped the grouped GEMM whose weights had no type (exit 101): quiet
    instantiation of the library's MoEExperts muted the E027 on its weights' dim. A size
    no tensor can have is now reported wherever it is found, by check and build alike."""
    from tests.test_cli import run

    text = (REPO_DIR / "examples/mixtral.module").read_text(encoding="utf-8")
    assert "d_ff: int = 3584," in text
    path = tmp_path / "mixtral.module"
    path.write_text(text.replace("d_ff: int = 3584,", "d_ff: int = " + "9" * 26 + ","),
                    encoding="utf-8")
    for result in (run("check", path), run("build", path, "-o", tmp_path / "m.ir")):
        assert result.exit_code == 1, result.output
        assert "error[E027]: a dimension must be at most 1,099,511,627,776" in result.output


def test_an_argument_of_the_wrong_kind_at_the_models_sizes_is_e003_at_build(tmp_path):
    """Found by the fuzz run (seed 6: GPT-2's `MLP(d_model, 1e308 * d_model)`): a block's
    argument that is a float only once the model sizes it (`2.5 * d`) was muted in quiet
    instantiation, so check passed and build lowered `Inner` with n = 10.0 (exit 101)."""
    from tests.test_cli import run

    path = REPO_DIR / "tests/ui/check/e003_argument_wrong_kind_at_model_sizes.module"
    for result in (run("check", path), run("build", path, "-o", tmp_path / "m.ir")):
        assert result.exit_code == 1, result.output
        assert "error[E003]: `Inner` parameter `n` is declared int, given 10.0" in result.output
        assert "note: in Outer(d=4)" in result.output


STACK_OF_N = """\
block Blk(d: int):
  params:
    w: [d]
  forward:
    in: x: [B, d]
    out: [B, d]
    graph:
      (x, w) -> add() -> out

model M(d: int = 4, n: int):
  params:
    blocks: [n] x Blk(d)
  forward:
    in: x: [B, d]
    out: [B, d]
    graph:
      x -> StackedBlocks(blocks, n) -> out
"""


def test_a_stack_sized_by_a_model_parameter_without_a_value_is_e012_at_build(tmp_path):
    """Found by the fuzz run (seed 4): a model parameter without a default that sizes a
    stack checks clean (the model is checked symbolically) but the Graph IR repeats a call
    a known number of times; build lowered `repeat=n` and the verifier refused it (exit
    101). Now E012 naming the parameter; with `--set n=2` it builds."""
    from tests.test_cli import run

    path = tmp_path / "stack.module"
    path.write_text(STACK_OF_N, encoding="utf-8")
    assert run("check", path).exit_code == 0
    result = run("build", path, "-o", tmp_path / "m.ir")
    assert result.exit_code == 1, result.output
    assert "error[E012]: the size of `blocks` (n) is not known in this build" in result.output
    assert "--set n=N" in result.output
    assert run("build", path, "--set", "n=2", "-o", tmp_path / "m.ir").exit_code == 0


def test_an_array_size_that_is_a_float_at_the_models_sizes_is_e003_at_build(tmp_path):
    """`blocks: [n / 2] x Blk(d)` in a module the model sizes with n = 2: the E003 was
    muted in quiet instantiation, the array dropped, and the lowering exited 101. (It is
    reported where `Tower` is checked on its own now: a float whatever the sizes.)"""
    from tests.test_cli import run

    path = REPO_DIR / "tests/ui/check/e003_array_size_float_at_model_sizes.module"
    result = run("build", path, "-o", tmp_path / "m.ir")
    assert result.exit_code == 1, result.output
    assert "error[E003]: an array of blocks' size must be an integer" in result.output
    # at the shape checker's sample sizes (Assumptions.samples): `n / 2` at one of them
    found = re.search(r"a float whatever the sizes \((\d+)\.0 when n = (\d+)\)", result.output)
    assert found and 2 * int(found[1]) == int(found[2]), result.output


FLAGGED = """\
model M(d: int = 4, flag: bool = true):
  params:
    w: [d]
    b: [d] if flag
  forward:
    in: a: [B, d]
    out: [B, d]
    graph:
      if flag:
        (a, b) -> add() -> out
      else:
        (a, w) -> mul() -> out
"""


def test_python_bool_settings_are_the_dsl_bools(tmp_path):
    """`Model.from_module(settings={"flag": False})` passed the word `False`, which was
    truthy (the model built with `b`); a word for a bool parameter is now E003, and
    Python's bools are written `true` / `false`."""
    from runtime.model import Model, parameter_shapes

    path = tmp_path / "flag.module"
    path.write_text(FLAGGED, encoding="utf-8")
    for flag, names in ((False, ["w"]), (True, ["b", "w"])):
        program = Model.from_module(path, settings={"flag": flag}).source.program(planned=False)
        assert sorted(parameter_shapes(program.graph)) == names


def test_two_failed_constraints_in_a_stack_are_errors_not_a_recursion():
    """Found by a fuzz run of small sizes (std Qwen3-MoE's verify sizes with num_heads 5):
    the failures of a stack's blocks were compared with `==`, which compared the instances
    field by field, the world's cache of instances included: RecursionError, exit 101."""
    sizes = {"vocab_size": "64", "d_model": "32", "n_layers": "2", "num_heads": "5",
             "num_kv_heads": "2", "head_dim": "8", "d_ff": "48", "moe_d_ff": "16",
             "num_experts": "4", "top_k": "2", "sparse_step": "2", "max_seq": "32"}
    result = build(BuildRequest(REPO_DIR / "std/models/qwen3_moe.module", settings=sizes))
    assert any(d.code == "E027" and "num_heads must be divisible by num_kv_heads" in d.message
               for d in result.diagnostics), result.diagnostics


def test_verify_sizes_check_the_weight_mapping_of_a_stack_empty_at_the_defaults(tmp_path):
    """Found by a fuzz run of --verify-backward: Qwen3-MoE's dense layers are an empty stack
    at its defaults (sparse_step 1), so a wrong `fuse(..., dim=3)` of theirs checked clean
    and the build at the `verify_backward:` sizes (sparse_step 2) refused it (E010)."""
    from tests.test_cli import run

    text = (REPO_DIR / "std/models/qwen3_moe.module").read_text(encoding="utf-8")
    old = 'j}.mlp.up_proj.weight",\n        dim=0'
    assert text.count(old) == 1
    path = tmp_path / "qwen3_moe.module"
    path.write_text(text.replace(old, old[:-1] + "3"), encoding="utf-8")
    result = run("check", path)
    assert result.exit_code == 1, result.output
    assert "error[E010]: `dim=3` is out of range for `blocks[{i}].dense[{j}].mlp.up_weight`" \
        in result.output and "at the sizes of `verify_backward:`" in result.output


@pytest.mark.parametrize("value,want", [(2, "2"), (True, "true"), (1e-05, "1e-05")])
def test_settings_given_from_python_are_read_as_their_text(value, want):
    """`Model.from_module(settings={"n_layers": 2})` gives numbers and bools, not text:
    they read as the `--set` text they print as (an int had no `.strip()`: exit 101)."""
    from modulec.check.given import setting_value

    assert setting_value(value) == setting_value(want)
