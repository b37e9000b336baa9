"""Hypothesis strategies for the syntax property tests (helper, not a test file).

- `programs()`: random but valid DSL source text (declarations, params, let bindings,
  forward graphs with flows, if/else blocks, tensor types, annotations).
- `int_expressions()`: integer arithmetic/boolean expressions that are valid Python as
  well as valid DSL, for checking operator precedence against Python's `eval`.
- `mutants(texts)`: source texts with a few random token-, line- and character-level edits.
"""

from __future__ import annotations

import re
from functools import lru_cache

from hypothesis import strategies as st

NAMES = ("x", "h", "q", "k", "v", "out", "hidden", "scale", "d_model", "n_heads", "W_q",
         "attn", "mlp", "residual", "B", "T", "C", "D", "use_bias", "eps")
OPS = ("linear", "matmul", "softmax", "view", "transpose", "rms_norm", "add", "split")
DTYPES = ("bf16", "fp32", "fp8_e4m3", "int")
KINDS = ("module", "block", "model", "primitive", "recipe", "abstract module")
BINARY = ("+", "-", "*", "/", "//", "%", "**", "and", "or", "==", "!=", "<", ">", "<=", ">=")
COMPARE = ("==", "!=", "<", ">", "<=", ">=")

name = st.sampled_from(NAMES)
decl_name = st.sampled_from(("Attention", "MLP", "Block", "Llama", "Norm")).flatmap(
    lambda base: st.integers(0, 99).map(lambda n: f"{base}{n}"))
number = st.one_of(st.integers(0, 4096).map(str), st.sampled_from(("1e-6", "0.5", "32_000")))
string = st.sampled_from(('"abc"', '"x must be > 0"', '""', r'"a\"b"'))


# ====================================================================== DSL expressions
@lru_cache(maxsize=None)
def _args(expr):
    positional = expr
    keyword = st.tuples(name, st.sampled_from(("=", ": ")), expr).map(lambda t: f"{t[0]}{t[1]}{t[2]}")
    return st.lists(st.one_of(positional, keyword), max_size=3).map(", ".join)


@lru_cache(maxsize=None)
def tensor_type() -> st.SearchStrategy[str]:
    dim = st.one_of(name, number, st.just("*"), st.sampled_from(DTYPES),
                    st.tuples(name, name).map(lambda t: f"{t[0]} * {t[1]}"))
    return st.lists(dim, min_size=1, max_size=4).map(lambda dims: "[" + ", ".join(dims) + "]")


def _extend(expr):
    return st.one_of(
        st.tuples(expr, st.sampled_from(BINARY), expr).map(lambda t: f"{t[0]} {t[1]} {t[2]}"),
        st.tuples(expr, st.sampled_from(COMPARE), expr, st.sampled_from(COMPARE), expr)
        .map(lambda t: " ".join(t)),
        expr.map(lambda e: f"({e})"),
        expr.map(lambda e: f"-{e}"),
        expr.map(lambda e: f"not {e}"),
        st.tuples(expr, expr, expr).map(lambda t: f"({t[0]} if {t[1]} else {t[2]})"),
        st.tuples(st.sampled_from(OPS), _args(expr)).map(lambda t: f"{t[0]}({t[1]})"),
        st.tuples(expr, tensor_type()).map(lambda t: f"[{t[0]}] x {t[1]}"),
        expr.map(lambda e: f"({e})?"),
        st.lists(expr, max_size=3).map(lambda items: "[" + ", ".join(items) + "]"),
    )


@lru_cache(maxsize=None)
def expressions(max_leaves: int = 8) -> st.SearchStrategy[str]:
    atom = st.one_of(name, number, string, st.sampled_from(("true", "false", "None")),
                     tensor_type(), st.tuples(name, name).map(".".join))
    return st.recursive(atom, _extend, max_leaves=max_leaves)


@lru_cache(maxsize=None)
def type_expr() -> st.SearchStrategy[str]:
    base = st.one_of(tensor_type(), st.sampled_from(("int", "float", "bool", "Tensor")))
    return st.one_of(base, base.map(lambda t: t + "?"),
                     st.tuples(st.one_of(name, number), base).map(lambda t: f"[{t[0]}] x {t[1]}"))


annotation = st.sampled_from(("@hook", "@checkpoint", "@gradient(skip)", "@shard(dim=0)",
                              '@hook(AfterQKV, mode: "replace")'))
annotations = st.lists(annotation, max_size=2).map(lambda a: "".join(" " + x for x in a))


# ====================================================================== items
@lru_cache(maxsize=None)
def _tuple_of_names(low: int = 2) -> st.SearchStrategy[str]:
    return st.lists(name, min_size=low, max_size=3).map(lambda ns: "(" + ", ".join(ns) + ")")


@lru_cache(maxsize=None)
def flows() -> st.SearchStrategy[str]:
    endpoint = st.one_of(name, _tuple_of_names())
    op = st.tuples(st.sampled_from(OPS), _args(expressions(3)), annotations).map(
        lambda t: f"{t[0]}({t[1]}){t[2]}")
    return st.tuples(endpoint, st.lists(op, min_size=1, max_size=4), endpoint).map(
        lambda t: " -> ".join([t[0], *t[1], t[2]]))


@st.composite
def graph_lines(draw, indent: str, depth: int = 1) -> list[str]:
    lines = [indent + flow for flow in draw(st.lists(flows(), min_size=1, max_size=3))]
    if depth > 0 and draw(st.booleans()):
        lines.append(f"{indent}if {draw(expressions(4))}:")
        lines += draw(graph_lines(indent + "  ", depth - 1))
        if draw(st.booleans()):
            lines.append(f"{indent}else:")
            lines += draw(graph_lines(indent + "  ", depth - 1))
    return lines


@st.composite
def params_section(draw) -> list[str]:
    lines = ["  params:"]
    for key in draw(st.lists(name, min_size=1, max_size=4, unique=True)):
        default = draw(st.one_of(st.just(""), expressions(3).map(lambda e: " = " + e)))
        lines.append(f"    {key}: {draw(type_expr())}{default}{draw(annotations)}")
    return lines


@st.composite
def let_section(draw) -> list[str]:
    bindings = draw(st.lists(st.tuples(name, expressions(8)), min_size=1, max_size=4))
    return ["  let:"] + [f"    {target} = {value}" for target, value in bindings]


@st.composite
def forward_section(draw) -> list[str]:
    source = draw(st.one_of(type_expr(), type_expr().map(lambda t: "x: " + t),
                            st.lists(st.tuples(name, type_expr()), min_size=1, max_size=3)
                            .map(lambda es: "(" + ", ".join(f"{n}: {t}" for n, t in es) + ")")))
    lines = ["  forward:", f"    in: {source}", f"    out: {draw(type_expr())}", "    graph:"]
    return lines + draw(graph_lines("      "))


SECTIONS = (params_section(), let_section(), forward_section())


@st.composite
def declaration(draw) -> str:
    head = f"{draw(st.sampled_from(KINDS))} {draw(decl_name)}"
    if draw(st.booleans()):
        params = draw(st.lists(st.tuples(name, st.sampled_from(("", ": int", ": float = 1.0"))),
                               max_size=3, unique_by=lambda p: p[0]))
        head += "(" + ", ".join(n + t for n, t in params) + ")"
    lines = [head + ":" + draw(annotations)]
    if draw(st.booleans()):
        lines.append('  """Generated declaration."""')
    for chosen in draw(st.lists(st.sampled_from(SECTIONS), min_size=1, max_size=2)):
        lines += draw(chosen)
    return "\n".join(lines) + "\n"


def programs() -> st.SearchStrategy[str]:
    imports = st.sampled_from(("", "import std.nn.Linear\n", "from std.nn import Linear, MLP as M\n"))
    return st.tuples(imports, st.lists(declaration(), min_size=1, max_size=2)).map(
        lambda t: t[0] + "\n".join(t[1]))


# ====================================================================== Python-valid integer expressions
@st.composite
def int_expressions(draw, budget: int = 12) -> str:
    """Follows Python's expression grammar, so `eval` reads the text as Python does."""
    left = [budget]

    def more(most: int) -> int:
        if left[0] <= 0:
            return 0
        extra = draw(st.integers(0, most))
        left[0] -= extra
        return extra

    def chain(sub, ops):
        operands = more(2) + 1  # decided before recursing, so every level gets a share
        text = sub()
        for _ in range(operands - 1):
            text += f" {draw(st.sampled_from(ops))} {sub()}"
        return text

    def ifexp():
        return f"{or_test()} if {or_test()} else {ifexp()}" if more(1) else or_test()

    def or_test():
        return chain(and_test, ("or",))

    def and_test():
        return chain(not_test, ("and",))

    def not_test():
        return "not " + not_test() if more(1) else chain(arith, COMPARE)

    def arith():
        return chain(term, ("+", "-"))

    def term():
        return chain(factor, ("*", "/", "//", "%"))

    def factor():
        return draw(st.sampled_from("-+")) + factor() if more(1) else power()

    def power():
        if not more(1):
            return atom()
        exponent = draw(st.sampled_from(("0", "1", "2", "3", "2 ** 2", "1 ** 3")))
        return f"{atom()} ** {exponent}"

    def atom():
        return f"({ifexp()})" if more(1) else str(draw(st.integers(0, 12)))

    return ifexp()


# ====================================================================== mutations
TOKEN = re.compile(r'"""[\s\S]*?"""|"(?:[^"\\\n]|\\.)*"|\w+|->|\*\*|//|[=!<>]=|\S')
INSERTABLE = '()[]{}:,->@=#"\t'


def _tokens(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in TOKEN.finditer(text)]


@st.composite
def _token_edit(draw, text: str) -> str:
    spans = _tokens(text)
    if len(spans) < 2:
        return text
    i = draw(st.integers(0, len(spans) - 2))
    (s1, e1), (s2, e2) = spans[i], spans[i + 1]
    kind = draw(st.sampled_from(("delete", "duplicate", "swap")))
    if kind == "delete":
        return text[:s1] + text[e1:]
    if kind == "duplicate":
        return text[:e1] + " " + text[s1:e1] + text[e1:]
    return text[:s1] + text[s2:e2] + text[e1:s2] + text[s1:e1] + text[e2:]


@st.composite
def _line_edit(draw, text: str) -> str:
    lines = text.splitlines(keepends=True)
    if len(lines) < 2:
        return text
    i = draw(st.integers(0, len(lines) - 2))
    kind = draw(st.sampled_from(("delete", "duplicate", "swap", "indent")))
    if kind == "delete":
        del lines[i]
    elif kind == "duplicate":
        lines.insert(i, lines[i])
    elif kind == "swap":
        lines[i], lines[i + 1] = lines[i + 1], lines[i]
    else:
        pad = draw(st.sampled_from(("", " ", "   ", "      ", "\t", "  \t")))
        lines[i] = pad + lines[i].lstrip(" \t")
    return "".join(lines)


@st.composite
def _char_insert(draw, text: str) -> str:
    at = draw(st.integers(0, len(text)))
    return text[:at] + draw(st.sampled_from(INSERTABLE)) + text[at:]


@st.composite
def mutants(draw, texts: list[str]) -> str:
    text = draw(st.sampled_from(texts))
    for _ in range(draw(st.integers(1, 3))):
        edit = draw(st.sampled_from((_token_edit, _line_edit, _char_insert)))
        text = draw(edit(text))
    return text
