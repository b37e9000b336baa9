"""Hypothesis strategies of small, mostly valid DSL programs for the soundness test
(helper, not a test file).

`small_programs()` draws a declaration `G(d: int = N)` whose graph is a random chain of
steps over `[B, d]` tensors: elementwise ops, matmuls with parameters, submodule calls,
binary ops, if/else on a flag, with random annotations on ops and parameters; and, by
feature, indexing, inline calls of a parameterless module, abstract modules, `pattern:`
blocks and stop-gradients. Each program comes with the set of features it uses, so a
feature whose lowering is known to be broken can be left out (see KNOWN_BROKEN in
test_soundness.py) while its failing case is kept as a strict xfail.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

UNARY = ("relu()", "silu()", "gelu()", "sigmoid()", "neg()", "copy()", "scale(0.5)",
         "exp()", "gelu(approximate=true)")
BINARY = ("add()", "mul()")
# annotation text -> the feature it exercises
OP_ANNOTATIONS = {
    "": "plain",
    " @checkpoint": "checkpoint",
    " @hook(AfterStep)": "hook",
    " @hook(AfterStep, mode: replace)": "hook",
    ' @profile("step")': "profile",
    " @gradient(skip)": "stop_gradient",
    " @gradient(scale=0.5)": "gradient_annotation",
    " @gradient(clip=1.0)": "gradient_annotation",
    " @dtype(fp32)": "dtype",
    " @dtype(bf16)": "dtype",
}
INPUT_ANNOTATIONS = {
    "": "plain",
    " @gradient(skip)": "stop_gradient",   # an input that is a stop-gradient, used elsewhere
    " @gradient(scale=0.5)": "gradient_annotation",
    " @dtype(fp32)": "dtype",
}
PARAM_ANNOTATIONS = {
    "": "plain",
    " @frozen": "frozen",
    " @trainable(lr_scale=0.5)": "trainable",
    " @trainable(wd_scale=0.0)": "trainable",
    " @gradient(scale=0.5)": "gradient_annotation",
    " @gradient(skip)": "gradient_annotation",
    " @dtype(fp32)": "dtype",
}

DOUBLE = """\
module Double:
  \"\"\"Parameterless: called inline as `Double()`.\"\"\"
  forward:
    in: x: [*]
    out: y: [*]
    graph:
      x -> scale(2.0) -> y
"""
ABSTRACT = """\
abstract module Base(d: int):
  params:
    w: [d, d]
  forward:
    in: x: [B, d]
    out: y: [B, d]

module Impl(d: int) extends Base:
  forward:
    graph:
      x -> matmul(w, transpose=NT) -> y
"""
PATTERN_BLOCK = """\
block Residual(d: int):
  params:
    norm1: RMSNormParams(d)
    sub1: Linear(d, d)
  pattern: sequential_residual
    sublayers:
      - (norm1, sub1)
"""
IMPORTS = ("import std.modules.linear.Linear\n"
           "import std.modules.norm.RMSNormParams\n")


@dataclass(frozen=True)
class Generated:
    text: str
    features: frozenset[str]


class _Graph:
    """The lines, parameters and features of one declaration being drawn."""

    def __init__(self, draw, d: int, known_broken: frozenset[str]):
        self.draw, self.d, self.broken = draw, d, known_broken
        self.lines: list[str] = []
        self.params: list[str] = []
        self.values = ["x"]  # names of [B, d] tensors
        self.features: set[str] = set()
        self.helpers: set[str] = set()
        self.flag = False
        self.input_annotation = ""

    def pick(self, options, label):
        return self.draw(st.sampled_from(options), label=label)

    def annotation(self, table: dict) -> str:
        allowed = [a for a, f in table.items() if f not in self.broken]
        text = self.pick(allowed, "annotation")
        self.features.add(table[text])
        return text

    def new(self) -> str:
        name = f"h{len(self.values)}"
        self.values.append(name)
        return name

    def source(self) -> str:
        # two in three from the last values: chains are long, not all fans from x
        recent = self.values[-2:]
        return self.pick(recent + recent + self.values, "source")

    def step(self, kind: str, indent: str) -> None:
        getattr(self, "_" + kind)(indent)

    def _unary(self, indent):
        src, op = self.source(), self.pick(UNARY, "op")
        self.lines.append(f"{indent}{src} -> {op}{self.annotation(OP_ANNOTATIONS)} -> {self.new()}")

    def _matmul(self, indent):
        weight = f"w{len(self.params)}"
        self.params.append(f"{weight}: [d, d]{self.annotation(PARAM_ANNOTATIONS)}")
        src = self.source()
        self.lines.append(f"{indent}{src} -> matmul({weight}, transpose=NT)"
                          f"{self.annotation(OP_ANNOTATIONS)} -> {self.new()}")

    def _linear(self, indent):
        layer = f"lin{len(self.params)}"
        bias = self.pick(("", ", bias=true"), "bias")
        self.params.append(f"{layer}: Linear(d, d{bias})")
        self.features.add("submodule")
        self.lines.append(f"{indent}{self.source()} -> {layer}{self.annotation(OP_ANNOTATIONS)}"
                          f" -> {self.new()}")

    def _binary(self, indent):
        a, b = self.source(), self.pick(self.values, "other")
        op = self.pick(BINARY, "binary")
        self.lines.append(f"{indent}({a}, {b}) -> {op}{self.annotation(OP_ANNOTATIONS)} -> {self.new()}")

    def _inline(self, indent):
        self.features.add("inline_call")
        self.helpers.add(DOUBLE)
        self.lines.append(f"{indent}{self.source()} -> Double() -> {self.new()}")

    def _abstract(self, indent):
        self.features.add("abstract_module")
        self.helpers.add(ABSTRACT)
        layer = f"impl{len(self.params)}"
        self.params.append(f"{layer}: Impl(d)")
        self.lines.append(f"{indent}{self.source()} -> {layer} -> {self.new()}")

    def _abstract_instance(self, indent):
        """A parameter whose type is the abstract module itself: refused or run."""
        self.features.add("abstract_instance")
        self.helpers.add(ABSTRACT)
        layer = f"base{len(self.params)}"
        self.params.append(f"{layer}: Base(d)")
        self.lines.append(f"{indent}{self.source()} -> {layer} -> {self.new()}")

    def _pattern(self, indent):
        self.features.add("pattern_block")
        self.helpers.add(PATTERN_BLOCK)
        layer = f"res{len(self.params)}"
        self.params.append(f"{layer}: Residual(d)")
        self.lines.append(f"{indent}{self.source()} -> {layer} -> {self.new()}")

    def _index(self, indent):
        """A view that keeps [B, d], or a column [B, 1] broadcast back over d."""
        self.features.add("indexing")
        src = self.source()
        index = self.pick((f"[:, 0:{self.d}]", "[:, :]", "[..., :]", "[:, -1:]", "[:, 0:1]"),
                          "index")
        op = self.pick(UNARY, "op")
        if index in ("[:, -1:]", "[:, 0:1]"):
            column = f"c{len(self.values)}"
            self.lines.append(f"{indent}{src}{index} -> {op} -> {column}")
            self.lines.append(f"{indent}({src}, {column}) -> mul() -> {self.new()}")
        else:
            self.lines.append(f"{indent}{src}{index} -> {op} -> {self.new()}")

    def _branch(self, indent):
        """if/else on the flag, both arms defining the same name."""
        self.features.add("conditional")
        self.flag = True
        src, target = self.source(), f"h{len(self.values)}"
        first, second = self.pick(UNARY, "then"), self.pick(UNARY, "else")
        self.lines += [f"{indent}if flag:", f"{indent}  {src} -> {first} -> {target}",
                       f"{indent}else:", f"{indent}  {src} -> {second} -> {target}"]
        self.values.append(target)


REFUSED = ("abstract_instance", "pattern_block")  # check refuses them today (E011, E012)
STEPS = {"unary": None, "matmul": None, "linear": "submodule", "binary": None,
         "inline": "inline_call", "abstract": "abstract_module", "index": "indexing",
         "branch": "conditional", "abstract_instance": "abstract_instance",
         "pattern": "pattern_block"}


@st.composite
def small_programs(draw, known_broken: frozenset[str] = frozenset()) -> Generated:
    d = draw(st.sampled_from((2, 3, 4)), label="d")
    graph = _Graph(draw, d, known_broken)
    # the refused kinds (an abstract module instantiated, a `pattern:` block) once in a
    # while: most programs should get past `check`
    kinds = [k for k, feature in STEPS.items() if feature not in known_broken
             for _ in range(1 if feature in REFUSED else 4)]
    for _ in range(draw(st.integers(1, 5), label="steps")):
        graph.step(draw(st.sampled_from(kinds), label="step"), "      ")
    _finish(graph)
    graph.input_annotation = graph.annotation(INPUT_ANNOTATIONS)
    kind = draw(st.sampled_from(("module", "block", "model")), label="kind")
    return Generated(_text(graph, kind), frozenset(graph.features))


def _finish(graph: _Graph) -> None:
    """The output: the last value, through one more op when it is the input itself."""
    last = graph.values[-1]
    if last == "x":
        graph.lines.append(f"      x -> relu() -> y")
    else:
        graph.lines.append(f"      {last} -> y")


def _text(graph: _Graph, kind: str) -> str:
    header = f"{kind} G(d: int = {graph.d}" + (", flag: bool = true" if graph.flag else "") + "):"
    params = ["  params:", *(f"    {p}" for p in graph.params)] if graph.params else []
    body = [header, *params, "  forward:", f"    in: x: [B, d]{graph.input_annotation}", "    out: y: [B, d]",
            "    graph:", *graph.lines]
    helpers = "".join(h + "\n" for h in sorted(graph.helpers))
    return IMPORTS + "\n" + helpers + "\n".join(body) + "\n"
