"""Mutation robustness of the whole checker (hypothesis; deterministic: derandomize=True).

Every file of std/, examples/ and tests/ui/clean/ is mutated at random (small edits in code,
not in comments or docstrings, that usually keep the syntax valid: rename an identifier to
another of the file or misspell it, change an integer, put a value of another kind (`None`,
a string, a float, a list) in place of a number or a name, swap, delete or duplicate an
item of a call, tuple or shape list, swap two lines of a block, delete a line, duplicate a
flow line, change a transpose mode or a section name) and checked with
`modulec check --format json`, in-process. Whatever the mutant says, the checker must
answer with diagnostics, never crash:

- exit status 0 or 1 (never 101, an internal compiler error, nor 2, a usage error), and 1
  exactly when an error is reported;
- every JSON line is an object with a code, a level and a message;
- a primary span in the mutated file lies inside it, with line/column and offsets that
  agree.

A crash fails with the mutated program, the edits made and the backtrace in the message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modulec.cli.main import modulec

ROOT = Path(__file__).resolve().parent.parent


def corpus() -> list[tuple[str, str]]:
    paths = [*sorted((ROOT / "std").rglob("*.module")),
             *sorted((ROOT / "examples").rglob("*.module")),
             *sorted((ROOT / "tests" / "ui" / "clean").rglob("*.module"))]
    return [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in paths]


CORPUS = corpus()
TEXTS = dict(CORPUS)
CODE = re.compile(r"[EW]\d{3}")

PROPERTY = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])
EXAMPLES_PER_KIND = 100   # x 11 kinds
EXAMPLES_STACKED = 400    # several edits at once


# ============================================================================ mutations
IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
INTEGER = re.compile(r"(?<![\w.])\d+(?![\w.])")
TRANSPOSE = re.compile(r"\btranspose\s*=\s*(\w+)")
SECTION = re.compile(r"^(\s*)([a-z_]+)(\s*:)", re.M)
SECTION_NAMES = ("params", "forward", "backward", "graph", "in", "out", "inputs", "outputs",
                 "save", "recompute", "let", "constraint", "impl", "precision", "hf_config",
                 "hf_mapping", "config", "body", "fowrard", "parms")
INTEGERS = ("0", "1", "2", "3", "4", "7", "8", "64", "4096", "1000003", "2147483648",
            "18446744073709551617")
MODES = ("NN", "NT", "TN", "TT", "XT", "nt", "T")
VALUES = ("None", "true", "false", "0.5", "-1", "0", '"x"', "[]", "[1, 2]", "1e-5", "(1, 2)")
VALUE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:e-?\d+)?|[A-Za-z_]\w*)(?![\w.(])")
KEYWORDS = frozenset({"module", "block", "model", "primitive", "recipe", "abstract", "import",
                      "from", "as", "if", "else", "and", "or", "not", "in", "x", "extends"})


@dataclass
class Mutant:
    name: str
    text: str
    edits: list[str]


def _pick(data, items, label: str):
    return items[data.draw(st.integers(0, len(items) - 1), label=label)]


@lru_cache(maxsize=256)  # the corpus's texts come back for every mutant drawn from them
def masks(text: str) -> tuple[str, str]:
    """(code, uncommented): the text with comments blanked, and with strings blanked too,
    offsets unchanged (so the edits look for names, numbers and brackets in code only)."""
    code, plain, i = list(text), list(text), 0

    def blank(chars, start, end):
        for k in range(start, end):
            if chars[k] != "\n":
                chars[k] = " "

    while i < len(text):
        c = text[i]
        if c == "#":
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            blank(code, i, end)
            blank(plain, i, end)
            i = end
        elif c == '"':
            quote = '"""' if text.startswith('"""', i) else '"'
            end = text.find(quote, i + len(quote))
            end = len(text) if end < 0 else end + len(quote)   # unterminated: to the end
            blank(code, i, end)
            i = end
        else:
            i += 1
    return "".join(code), "".join(plain)


def _rename(text: str, data, hows: tuple[str, ...]) -> tuple[str, str] | None:
    found = list(IDENT.finditer(masks(text)[0]))
    if not found:
        return None
    m = _pick(data, found, "occurrence")
    word = m.group()
    how = data.draw(st.sampled_from(hows), label="how")
    i = data.draw(st.integers(0, max(len(word) - 2, 0)), label="index")
    if how == "other":
        new = _pick(data, sorted({f.group() for f in found}), "other name")
    elif how == "drop" and len(word) > 1:
        new = word[:i] + word[i + 1:]
    elif how == "double":
        new = word[:i] + word[i] + word[i:]
    elif how == "swap" and len(word) > 1:
        new = word[:i] + word[i + 1] + word[i] + word[i + 2:]
    else:
        new = word.swapcase()
    return text[:m.start()] + new + text[m.end():], f"rename `{word}` at {m.start()} to `{new}`"


def rename_identifier(text: str, data):
    """Another identifier of the same file."""
    return _rename(text, data, ("other",))


def near_miss_identifier(text: str, data):
    """A misspelling: a letter dropped, doubled or swapped with the next, or case changed."""
    return _rename(text, data, ("drop", "double", "swap", "case"))


def change_integer(text: str, data) -> tuple[str, str] | None:
    found = list(INTEGER.finditer(masks(text)[0]))
    if not found:
        return None
    m = _pick(data, found, "integer")
    old = m.group()
    new = data.draw(st.sampled_from([*INTEGERS, str(int(old) + 1), str(max(int(old) - 1, 0))]),
                    label="value")
    return text[:m.start()] + new + text[m.end():], f"integer {old} at {m.start()} -> {new}"


def change_value_kind(text: str, data) -> tuple[str, str] | None:
    """A number or a name in code becomes a value of another kind (`None`, a bool, a
    float, a negative number, a string, a list)."""
    code = masks(text)[0]
    found = [m for m in VALUE.finditer(code) if m.group() not in KEYWORDS]
    if not found:
        return None
    m = _pick(data, found, "value")
    new = data.draw(st.sampled_from(VALUES), label="new value")
    return text[:m.start()] + new + text[m.end():], f"value `{m.group()}` at {m.start()} -> {new}"


def _bracket_lists(code: str, opener: str) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(start, end, item spans) of every `opener ... closer` with top-level commas in
    `code` (strings and comments blanked): the comma-separated parts between the brackets."""
    closer = {"(": ")", "[": "]"}[opener]
    pairs, stack = [], []
    for i, c in enumerate(code):
        if c in "([":
            stack.append((c, i, []))
        elif c in ")]" and stack:
            kind, start, commas = stack.pop()
            if kind == opener and c == closer and commas:
                bounds = [start + 1, *[k + 1 for k in commas]]
                ends = [*commas, i]
                pairs.append((start, i, list(zip(bounds, ends))))
        elif c == "," and stack:
            stack[-1][2].append(i)
    return pairs


def _edit_list(text: str, data, opener: str, what: str) -> tuple[str, str] | None:
    code, plain = masks(text)
    lists = _bracket_lists(code, opener)
    if not lists:
        return None
    start, end, items = _pick(data, lists, "list")
    texts = [plain[a:b].strip() for a, b in items]   # without comments: joined on one line
    op = data.draw(st.sampled_from(["swap", "delete", "duplicate"]), label="list edit")
    i = data.draw(st.integers(0, len(texts) - 1), label="item")
    if op == "swap":
        j = data.draw(st.integers(0, len(texts) - 1), label="other item")
        texts[i], texts[j] = texts[j], texts[i]
    elif op == "delete":
        del texts[i]
    else:
        texts.insert(i, texts[i])
    new = ", ".join(texts)
    return (text[:start + 1] + new + text[end:],
            f"{op} {what} item {i} of `{text[start:end + 1]}` -> `{text[start]}{new}{text[end]}`")


def edit_call_arguments(text: str, data):
    return _edit_list(text, data, "(", "call/tuple")


def edit_shape(text: str, data):
    return _edit_list(text, data, "[", "shape/list")


def _code_lines(text: str) -> list[str]:
    """The lines of the text with strings and comments blanked (docstrings are blank)."""
    return masks(text)[0].split("\n")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def swap_lines(text: str, data) -> tuple[str, str] | None:
    lines, code = text.split("\n"), _code_lines(text)
    indented = [i for i, line in enumerate(code) if line.strip() and _indent(line) > 0]
    if not indented:
        return None
    i = _pick(data, indented, "line")
    partners = []
    for j in range(i + 1, len(lines)):
        if code[j].strip() and _indent(code[j]) < _indent(code[i]):
            break
        if code[j].strip() and _indent(code[j]) == _indent(code[i]):
            partners.append(j)
    if not partners:
        return None
    j = _pick(data, partners, "partner")
    lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines), f"swap lines {i + 1} and {j + 1}"


def delete_line(text: str, data) -> tuple[str, str] | None:
    lines, code = text.split("\n"), _code_lines(text)
    candidates = [i for i, line in enumerate(code) if line.strip()]
    if not candidates:
        return None
    i = _pick(data, candidates, "line")
    gone = lines.pop(i)
    return "\n".join(lines), f"delete line {i + 1} `{gone.strip()}`"


def duplicate_flow_line(text: str, data) -> tuple[str, str] | None:
    lines, code = text.split("\n"), _code_lines(text)
    flows = [i for i, line in enumerate(code) if "->" in line]
    if not flows:
        return None
    i = _pick(data, flows, "flow")
    where = data.draw(st.sampled_from(["after", "before"]), label="where")
    lines.insert(i + 1 if where == "after" else i, lines[i])
    return "\n".join(lines), f"duplicate line {i + 1} `{lines[i].strip()}` ({where})"


def change_transpose(text: str, data) -> tuple[str, str] | None:
    found = list(TRANSPOSE.finditer(masks(text)[0]))
    if not found:
        return None
    m = _pick(data, found, "transpose")
    new = data.draw(st.sampled_from([mode for mode in MODES if mode != m.group(1)]),
                    label="mode")
    return (text[:m.start(1)] + new + text[m.end(1):],
            f"transpose={m.group(1)} at {m.start()} -> {new}")


def change_section_name(text: str, data) -> tuple[str, str] | None:
    found = [m for m in SECTION.finditer(masks(text)[0]) if m.group(2) in SECTION_NAMES]
    if not found:
        return None
    m = _pick(data, found, "section")
    new = data.draw(st.sampled_from([s for s in SECTION_NAMES if s != m.group(2)]),
                    label="name")
    return (text[:m.start(2)] + new + text[m.end(2):],
            f"section `{m.group(2)}:` at line {text.count(chr(10), 0, m.start()) + 1} -> `{new}:`")


MUTATIONS = {
    "rename_identifier": rename_identifier,
    "near_miss_identifier": near_miss_identifier,
    "change_integer": change_integer,
    "change_value_kind": change_value_kind,
    "edit_call_arguments": edit_call_arguments,
    "edit_shape": edit_shape,
    "swap_lines": swap_lines,
    "delete_line": delete_line,
    "duplicate_flow_line": duplicate_flow_line,
    "change_transpose": change_transpose,
    "change_section_name": change_section_name,
}
# What a file needs for a mutation to find something to edit (in code, not in comments).
NEEDS = {"change_transpose": TRANSPOSE.search, "duplicate_flow_line": re.compile("->").search}


def files(kinds: tuple[str, ...]):
    """A corpus file: two times in three a module, block or model (the primitives are many
    and short, and most of the checker works on the others), else a primitive."""
    fits = [(name, text) for name, text in CORPUS
            if len(kinds) > 1 or kinds[0] not in NEEDS or NEEDS[kinds[0]](masks(text)[0])]
    primitives = [c for c in fits if c[0].startswith("std/primitives/")]
    others = [c for c in fits if c not in primitives]
    return st.one_of(st.sampled_from(primitives), st.sampled_from(others),
                     st.sampled_from(others))


@st.composite
def mutants(draw, kinds: tuple[str, ...], count=st.integers(1, 1)):
    name, text = draw(files(kinds), label="file")
    edits = []
    for _ in range(draw(count, label="edits")):
        kind = draw(st.sampled_from(kinds), label="kind")
        done = MUTATIONS[kind](text, _Data(draw))
        if done is not None:
            text, what = done
            edits.append(f"{kind}: {what}")
    return Mutant(name, text, edits)


class _Data:
    """`data.draw` for the mutation functions, inside a composite strategy."""

    def __init__(self, draw):
        self._draw = draw

    def draw(self, strategy, label=None):
        return self._draw(strategy, label=label)


# ============================================================================ the check
@pytest.fixture(scope="module")
def mutant_path(tmp_path_factory) -> Path:
    """Where each mutant is written (a folder of its own: its only neighbour is itself)."""
    return tmp_path_factory.mktemp("mutants") / "mutant.module"


def run_check(mutant: Mutant, path: Path) -> int:
    """`modulec check --format json` on the mutant: the exit status, after the checks."""
    path.write_text(mutant.text, encoding="utf-8")
    result = CliRunner(env={"MODULEC_BACKTRACE": "1"}).invoke(
        modulec, ["check", "--format", "json", str(path)])
    where = (f"mutant of {mutant.name}\nedits:\n  " + "\n  ".join(mutant.edits or ["(none)"])
             + f"\n--- program ---\n{mutant.text}\n--- end ---\n")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        pytest.fail(f"uncaught {result.exception!r}\n{where}", pytrace=False)
    assert result.exit_code in (0, 1), (
        f"`modulec check` exited with status {result.exit_code}"
        f"{' (internal compiler error)' if result.exit_code == 101 else ''}\n{where}"
        f"--- stderr ---\n{_shorten(result.stderr)}")
    diagnostics = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    errors = [d for d in diagnostics if d.get("level") == "error"]
    assert result.exit_code == (1 if errors else 0), \
        f"exit status {result.exit_code} with {len(errors)} errors\n{where}{result.stdout}"
    for d in diagnostics:
        check_diagnostic(d, str(path), mutant.text, where)
    return result.exit_code


def _shorten(text: str, head: int = 1500, tail: int = 3000) -> str:
    """A long backtrace (a RecursionError's) cut in the middle."""
    if len(text) <= head + tail:
        return text
    return f"{text[:head]}\n[... {len(text) - head - tail} characters ...]\n{text[-tail:]}"


def check_diagnostic(d: dict, file_name: str, text: str, where: str) -> None:
    shown = json.dumps({k: d.get(k) for k in ("code", "level", "message", "spans")})[:1500]
    assert isinstance(d.get("code"), str) and CODE.fullmatch(d["code"]), f"code: {shown}\n{where}"
    assert d.get("level") in ("error", "warning"), f"level: {shown}\n{where}"
    assert isinstance(d.get("message"), str) and d["message"].strip(), \
        f"message: {shown}\n{where}"
    primary = [s for s in d.get("spans", []) if s.get("is_primary")]
    assert len(primary) <= 1, f"several primary spans: {shown}\n{where}"
    for span in primary:
        if span["file_name"] == file_name:
            problem = span_problem(span, text)
            assert problem is None, f"primary span {problem}: {shown}\n{where}"


def span_problem(span: dict, text: str) -> str | None:
    start, end = span["byte_start"], span["byte_end"]
    if not 0 <= start <= end <= len(text):
        return f"offsets {start}..{end} outside the file (length {len(text)})"
    for offset, line, column, which in ((start, span["line_start"], span["column_start"],
                                         "start"),
                                        (end, span["line_end"], span["column_end"], "end")):
        expected = position(text, offset)
        if (line, column) != expected:
            return f"{which} at line {line} column {column}, but offset {offset} is at " \
                   f"line {expected[0]} column {expected[1]}"
    return None


def position(text: str, offset: int) -> tuple[int, int]:
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


# ============================================================================ properties
def test_the_corpus_checks_clean(mutant_path):
    """The unmutated files are the baseline: each checks without errors."""
    for name, text in CORPUS:
        assert run_check(Mutant(name, text, []), mutant_path) == 0, name


@pytest.mark.parametrize("kind", list(MUTATIONS))
@settings(PROPERTY, max_examples=EXAMPLES_PER_KIND)
@given(data=st.data())
def test_one_mutation_never_crashes_the_checker(mutant_path, kind, data):
    run_check(data.draw(mutants((kind,)), label="mutant"), mutant_path)


@settings(PROPERTY, max_examples=EXAMPLES_STACKED)
@given(mutant=mutants(tuple(MUTATIONS), count=st.integers(2, 4)))
def test_several_mutations_never_crash_the_checker(mutant_path, mutant):
    run_check(mutant, mutant_path)


# ============================================================================ found so far
# Mutants that failed (with random seeds, or in earlier runs), each kept as a fixed case so
# that it fails until fixed, whatever the generated examples happen to cover.
def _edited(name: str, old: str, new: str) -> Mutant:
    assert TEXTS[name].count(old) == 1, f"{old!r} not found once in {name}"
    return Mutant(name, TEXTS[name].replace(old, new), [f"replace `{old}` by `{new}`"])


SELF_CONTAINING_MODEL = """\
model Rec(d: int = 8):
  params:
    inner: Rec(d)

  forward:
    in: x: [B, d]
    out: y: [B, d]
    graph:
      x -> inner -> y
"""
SELF_CONTAINING_MODULE_OTHER_SIZE = """\
module Rec(d: int):
  params:
    inner: Rec(d + 1)

  forward:
    in: x: [B, d]
    out: y: [B, d]
    graph:
      x -> inner -> y
"""
WRONG_KIND_IN_CONSTRAINT = """\
model Top(d: int = {value}):
  let:
    constraint:
      d > 0, "d must be positive"

  forward:
    in: x: [B, 8]
    out: y: [B, 8]
    graph:
      x -> relu() -> y
"""
RECOVERED_SECTION = """\
block B(d: int):
  forward:
    in: x: [B, d]
    out: y: [B, d]
    graph:
      x -> y
  a: int = 1,
  eps: float = 1e-5
"""
FOUND = {
    # RecursionError in check/driver.py check_tree: the model contains itself
    "model_named_like_its_submodule": lambda: _edited(
        "examples/mistral.module", "model SmallMistral(", "model RMSNormParams("),
    "self_containing_model": lambda: Mutant("(minimal)", SELF_CONTAINING_MODEL, []),
    # RecursionError in check/instance.py instantiate: a module contains itself, other sizes
    "block_containing_itself_other_size": lambda: _edited(
        "std/blocks/dense.module", "ln1: RMSNormParams(d_model, eps)",
        "ln1: DenseTransformerBlock(d_model, num_heads, num_kv_heads, d_ff + 1, max_seq)"),
    "self_containing_module_other_size": lambda: Mutant(
        "(minimal)", SELF_CONTAINING_MODULE_OTHER_SIZE, []),
    # TypeError in semantic/consteval.py: a constraint orders `None`, a string or a tuple
    # (given for an `int` parameter, which nothing rejects)
    "none_for_num_heads": lambda: _edited(
        "std/models/llama.module", "      d_model, num_heads, num_kv_heads, d_ff, max_seq, eps,",
        "      d_model, None, num_kv_heads, d_ff, max_seq, eps,"),
    "none_in_constraint": lambda: Mutant(
        "(minimal)", WRONG_KIND_IN_CONSTRAINT.format(value="None"), []),
    "string_in_constraint": lambda: Mutant(
        "(minimal)", WRONG_KIND_IN_CONSTRAINT.format(value='"x"'), []),
    "tuple_in_constraint": lambda: Mutant(
        "(minimal)", WRONG_KIND_IN_CONSTRAINT.format(value="(1, 2)"), []),
    # A tree node's span after error recovery: offsets of the patched text, not the file's
    "span_after_recovery": lambda: Mutant("(minimal)", RECOVERED_SECTION, []),
}


@pytest.mark.parametrize("case", list(FOUND))
def test_mutants_found_earlier(mutant_path, case):
    run_check(FOUND[case](), mutant_path)
