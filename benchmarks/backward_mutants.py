"""Mutation testing of the std library's explicit backward graphs (issue 5, item 3).

Every `backward: graph:` written in a module, block or model of the given files (default:
all of std/) is mutated one step at a time:

  swap-outputs     `-> (a, b)` becomes `-> (b, a)` (every pair of named outputs)
  swap-inputs      `(a, b) -> op()` becomes `(b, a) -> op()` (every pair of inputs)
  flip-transpose   one letter of one `transpose=XY` mode (NN -> TN and NN -> NT, ...)
  drop-accumulate  one `accumulate=true` removed
  scale            one term times 0.5: `alpha=0.5` on a matmul (or a changed alpha), a
                   `scale(0.5)` step before a single destination, or, for an op with several
                   outputs, on one of its gradient inputs

Each mutant is the file with that one edit, written to a scratch folder under the same
relative path (imports of `std.*` resolve to the bundled std/). It is killed when
`modulec check` reports an error (a type error counts), when the mutated declaration does
not build, or when `--verify-backward` finds a gradient that does not match finite
differences; only the mutated declaration is verified. A mutant inside `if p:` / `else:`
of the backward is verified with `--set p=true` / `p=false`, so that its branch runs.

    PYTHONPATH=. python benchmarks/backward_mutants.py [PATH...] [--jobs 2] [--json out.json]

Prints a table (file, declaration, kind: generated, killed by check, killed by the
verifier, survived), every survivor with its diff, and the runtime. Exit status 1 when a
mutant survives or an unmutated declaration fails its own check.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KINDS = ("swap-outputs", "swap-inputs", "flip-transpose", "drop-accumulate", "scale")
DECL_KINDS = ("module", "block", "model")
MATMULS = ("matmul", "matmul_backward")
FACTOR = "0.5"
SCALED = "mutant_scaled_"  # a local name no std graph uses
FLIP = {"N": "T", "T": "N"}
# verdict -> table column: a type error from `check`, or from the build of the settings
# that take the mutated branch (`check` types a declaration at its defaults)
COLUMN = {"check": "killed_types", "build": "killed_types", "verify": "killed_gradients",
          "crash": "killed_crash", "survived": "survived"}


@dataclass
class Mutant:
    file: str  # relative to the root of the files (std/modules/mlp.module)
    declaration: str
    kind: str
    description: str
    line: int
    text: str  # the whole mutated file
    origin: str  # the original file
    settings: dict[str, str] = field(default_factory=dict)  # takes the mutated branch

    @property
    def ident(self) -> str:
        return f"{self.file}:{self.line}:{self.declaration}:{self.kind}:{self.description}"


@dataclass
class Outcome:
    ident: str
    file: str
    declaration: str
    kind: str
    description: str
    settings: dict[str, str]
    verdict: str  # "check" | "build" (type errors), "verify" | "crash" (killed) or "survived"
    detail: str
    diff: str = ""

    @property
    def killed(self) -> bool:
        return self.verdict != "survived"


# ====================================================================== generation
@dataclass(frozen=True)
class _Flow:
    decl: str
    flow: object  # modulec.syntax.ast.Flow
    settings: tuple[tuple[str, str], ...]


def generate(path: Path) -> list[Mutant]:
    """Every one-step mutant of the explicit backward graphs of the file `path`."""
    from modulec.source import SourceFile
    from modulec.syntax import parser

    source = SourceFile.read(path)
    result = parser.parse_source(source)
    if result.program is None:
        raise SystemExit(f"{path}: does not parse")
    rel = _relative(path)
    mutants = []
    for flow in backward_flows(result.program):
        for kind, description, edits in _mutations(flow.flow, source.text):
            mutants.append(Mutant(rel, flow.decl, kind, description,
                                  flow.flow.span.line, apply_edits(source.text, edits),
                                  str(path.resolve()), dict(flow.settings)))
    return mutants


def _relative(path: Path) -> str:
    """std/modules/mlp.module for a file of this repository, else the file's name."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def backward_flows(program) -> list[_Flow]:
    """The flows of every `backward: graph:` (recompute: and if/else blocks included), with
    the settings that take their branch."""
    flows = []
    for decl in program.decls:
        if decl.kind not in DECL_KINDS:
            continue
        for backward in decl.sections("backward"):
            for graph in backward.body:
                if _is_section(graph, "graph"):
                    flows += _walk(decl.name, graph.body, ())
    return flows


def _walk(decl: str, items, settings: tuple) -> list[_Flow]:
    from modulec.syntax import ast as A

    flows = []
    for item in items:
        if isinstance(item, A.Flow):
            flows.append(_Flow(decl, item, settings))
        elif isinstance(item, A.Section):
            flows += _walk(decl, item.body, settings)
        elif isinstance(item, A.IfBlock):
            flows += _walk(decl, item.body, settings + _branch(item.test, True))
            flows += _walk(decl, item.orelse or (), settings + _branch(item.test, False))
    return flows


def _branch(test, taken: bool) -> tuple:
    """`if p:` -> (("p", "true"),); `if not p:` the inverse; other tests: no setting (the
    declaration's own configuration decides which branch runs)."""
    from modulec.syntax import ast as A

    if isinstance(test, A.Unary) and test.op == "not":
        return _branch(test.operand, not taken)
    if isinstance(test, A.Name):
        return ((test.id, "true" if taken else "false"),)
    return ()


def _is_section(item, name: str) -> bool:
    from modulec.syntax import ast as A

    return isinstance(item, A.Section) and isinstance(item.key, A.Name) and item.key.id == name


def _mutations(flow, text: str):
    """(kind, description, edits) for every mutant of one flow; an edit is (start, end, new)."""
    yield from _swap_outputs(flow, text)
    yield from _swap_inputs(flow, text)
    for step in flow.operations:
        yield from _flip_transpose(step, text)
        yield from _drop_accumulate(step, text)
    yield from _scale(flow, text)


def _names(tuple_expr, text: str) -> list:
    return [e for e in tuple_expr.items if _src(e, text) != "_"]


def _swap_outputs(flow, text: str):
    from modulec.syntax import ast as A

    if isinstance(flow.destination.expr, A.TupleExpr):
        for a, b in combinations(_names(flow.destination.expr, text), 2):
            yield "swap-outputs", f"-> ({_src(a, text)} <-> {_src(b, text)})", _swap(a, b, text)


def _swap_inputs(flow, text: str):
    from modulec.syntax import ast as A

    if isinstance(flow.source.expr, A.TupleExpr):
        for a, b in combinations(flow.source.expr.items, 2):
            if _src(a, text) != _src(b, text):
                yield "swap-inputs", f"({_src(a, text)} <-> {_src(b, text)}) ->", \
                    _swap(a, b, text)


def _swap(a, b, text: str) -> list:
    return [(a.span.start, a.span.end, _src(b, text)), (b.span.start, b.span.end, _src(a, text))]


def _flip_transpose(step, text: str):
    for arg in _args(step):
        mode = _src(arg.value, text)
        if _key(arg) == "transpose" and len(mode) == 2 and set(mode) <= {"N", "T"}:
            for i in (0, 1):
                new = mode[:i] + FLIP[mode[i]] + mode[i + 1:]
                yield "flip-transpose", f"{_callee(step)}: transpose={mode} -> {new}", \
                    [(arg.value.span.start, arg.value.span.end, new)]


def _drop_accumulate(step, text: str):
    args = _args(step)
    for i, arg in enumerate(args):
        if _key(arg) == "accumulate" and _src(arg.value, text) == "true":
            # the argument and the comma that separates it from its neighbour
            start = args[i - 1].span.end if i > 0 else arg.span.start
            end = arg.span.end if i > 0 or len(args) == 1 else args[1].span.start
            yield "drop-accumulate", f"{_callee(step)}: accumulate=true dropped", \
                [(start, end, "")]


def _scale(flow, text: str):
    """One term times 0.5: the alpha of a matmul, else the flow's single result, else (an op
    with several outputs) one of its gradient inputs."""
    from modulec.syntax import ast as A

    matmuls = [s for s in flow.operations if _callee(s) in MATMULS]
    for step in matmuls:
        yield "scale", f"{_callee(step)}: alpha x 0.5", [_alpha_edit(step, text)]
    if matmuls:
        return
    if isinstance(flow.destination.expr, A.Name):
        dest = flow.destination.span.start
        yield "scale", f"scale({FACTOR}) before -> {_src(flow.destination, text)}", \
            [(dest, dest, f"scale({FACTOR}) -> ")]
    elif isinstance(flow.source.expr, A.TupleExpr):
        for element in flow.source.expr.items:
            name = _src(element, text)
            if name.startswith("d_"):
                yield "scale", f"input {name} x {FACTOR}", _scale_input(flow, element, text)


def _alpha_edit(step, text: str) -> tuple:
    for arg in _args(step):
        if _key(arg) == "alpha":
            old = float(_src(arg.value, text))
            return arg.value.span.start, arg.value.span.end, repr(old * float(FACTOR))
    call = step.expr
    close = call.span.end - 1  # the `)`
    assert text[close] == ")", text[call.span.start:call.span.end]
    return close, close, (", " if call.args else "") + f"alpha={FACTOR}"


def _scale_input(flow, element, text: str) -> list:
    name = _src(element, text)
    line_start = text.rfind("\n", 0, flow.span.start) + 1
    indent = text[line_start:flow.span.start]
    scaled = f"{SCALED}{name}"
    return [(line_start, line_start, f"{indent}{name} -> scale({FACTOR}) -> {scaled}\n"),
            (element.span.start, element.span.end, scaled)]


def _args(step) -> tuple:
    from modulec.syntax import ast as A

    return step.expr.args if isinstance(step.expr, A.Call) else ()


def _key(arg) -> str | None:
    return getattr(arg.key, "id", None)


def _callee(step) -> str:
    from modulec.syntax import ast as A

    expr = step.expr
    return expr.func.id if isinstance(expr, A.Call) and isinstance(expr.func, A.Name) else ""


def _src(node, text: str) -> str:
    return text[node.span.start:node.span.end]


def apply_edits(text: str, edits) -> str:
    for start, end, new in sorted(edits, key=lambda edit: edit[0], reverse=True):
        text = text[:start] + new + text[end:]
    return text


# ====================================================================== running
def run_mutant(mutant: Mutant, scratch: Path, index: int) -> Outcome:
    """Check the mutant, then verify its declaration's backward; the first failure kills."""
    path = scratch / str(index) / mutant.file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(mutant.text, encoding="utf-8")
    verdict, detail = _judge(path, mutant.declaration, mutant.settings)
    return Outcome(mutant.ident, mutant.file, mutant.declaration, mutant.kind,
                   mutant.description, mutant.settings, verdict, detail)


def _judge(path: Path, declaration: str, settings: dict) -> tuple[str, str]:
    errors, program = _check(path)
    if errors:
        return "check", errors[0]
    decl = next(d for d in program.decls if d.name == declaration)
    return _verify(path, decl, settings)


def _check(path: Path):
    import click

    from modulec.cli.inputs import CheckOptions, check_one

    with click.Context(click.Command("check")):
        result = check_one(path, CheckOptions())
    errors = [f"{d.code} {d.message}" for d in result.diagnostics if d.is_error]
    if result.program is None and not errors:
        errors = ["does not parse"]
    return errors, result.program


def _verify(path: Path, decl, settings: dict) -> tuple[str, str]:
    from runtime.errors import RuntimeUserError
    from runtime.verify import VerifyOptions, verify_declaration

    try:
        rows = verify_declaration(path, decl, VerifyOptions(settings=dict(settings)))
    except RuntimeUserError as exc:  # a type error where the settings take the branch
        return "build", _first_error(exc)
    except Exception as exc:  # noqa: BLE001 - a crash of the interpreter detects it too
        return "crash", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    failed = [f"{r.backward} {r.gradient} ({_error(r)})" for r in rows if not r.ok]
    if failed:
        return "verify", ", ".join(failed)
    return "survived", f"{len(rows)} gradients match"


def _first_error(exc) -> str:
    lines = [line for text in exc.help for line in text.splitlines()]
    return next((line.strip() for line in lines if line.lstrip().startswith("error")),
                exc.message)


def _error(row) -> str:
    return row.note or ("-" if row.error is None else f"rel err {row.error:.1e}")


def run_all(mutants: list[Mutant], jobs: int) -> list[Outcome]:
    with tempfile.TemporaryDirectory(prefix="backward_mutants_") as scratch:
        indexed = list(enumerate(mutants))
        if jobs <= 1:
            return [run_mutant(m, Path(scratch), i) for i, m in indexed]
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(run_mutant, m, Path(scratch), i) for i, m in indexed]
            return [f.result() for f in futures]


def baseline(mutants: list[Mutant]) -> list[str]:
    """The unmutated declarations under every setting a mutant uses: each must pass, or a
    kill would mean nothing. Returns the failures."""
    cases = sorted({(m.origin, m.declaration, tuple(sorted(m.settings.items())))
                    for m in mutants})
    failures = []
    for file, declaration, settings in cases:
        verdict, detail = _judge(Path(file), declaration, dict(settings))
        if verdict != "survived":
            failures.append(f"{file} {declaration} {dict(settings)}: {verdict}: {detail}")
    return failures


def with_diffs(outcomes: list[Outcome], mutants: list[Mutant]) -> None:
    for outcome, mutant in zip(outcomes, mutants):
        if not outcome.killed:
            outcome.diff = diff(mutant)


def diff(mutant: Mutant) -> str:
    before = Path(mutant.origin).read_text(encoding="utf-8").splitlines(keepends=True)
    after = mutant.text.splitlines(keepends=True)
    return "".join(difflib.unified_diff(before, after, mutant.file, f"{mutant.file} (mutant)",
                                        n=1))


# ====================================================================== report
def summary(outcomes: list[Outcome]) -> dict:
    rows: dict[tuple, dict] = {("total", "", kind): _zero() for kind in KINDS}
    for o in outcomes:
        for key in ((o.file, o.declaration, o.kind), ("total", "", o.kind), ("total", "", "")):
            row = rows.setdefault(key, _zero())
            row["generated"] += 1
            row[COLUMN[o.verdict]] += 1
    return rows


def _zero() -> dict:
    return {"generated": 0, "killed_types": 0, "killed_gradients": 0, "killed_crash": 0,
            "survived": 0}


def print_table(rows: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("file", "declaration", "kind", "generated", "killed: types",
                  "killed: gradients", "killed: crash", "survived", box=None, pad_edge=False)
    for (file, decl, kind), row in sorted(rows.items(), key=_row_order):
        table.add_row(file, decl, kind or "all", *(str(v) for v in row.values()),
                      style="bold red" if row["survived"] else None)
    Console(highlight=False, width=140).print(table)


def _row_order(item):
    (file, decl, kind), _ = item
    return (file == "total", file, decl, kind == "", KINDS.index(kind) if kind else 0)


def print_survivors(outcomes: list[Outcome]) -> None:
    for o in outcomes:
        if not o.killed:
            print(f"\nSURVIVED {o.ident} settings={o.settings}\n{o.diff}")


def to_json(outcomes, rows, seconds: float, jobs: int, baseline_failures) -> dict:
    return {"seconds": round(seconds, 2), "jobs": jobs, "baseline_failures": baseline_failures,
            "summary": [{"file": f, "declaration": d, "kind": k or "all", **r}
                        for (f, d, k), r in sorted(rows.items(), key=_row_order)],
            "mutants": [asdict(o) for o in outcomes]}


# ====================================================================== main
def std_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for p in (root / "std").rglob("*.module") if "primitives" not in p.parts)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    paths = [Path(p) for p in args.paths] or std_files()
    mutants = [m for p in paths for m in generate(p)]
    mutants = [m for m in mutants if not args.kind or m.kind in args.kind]
    failures = baseline(mutants)
    outcomes = run_all(mutants, args.jobs)
    with_diffs(outcomes, mutants)
    seconds = time.perf_counter() - start
    rows = summary(outcomes)
    print_table(rows)
    print_survivors(outcomes)
    for failure in failures:
        print(f"BASELINE FAILS: {failure}")
    print(f"\n{len(mutants)} mutants, {sum(o.killed for o in outcomes)} killed, "
          f"{sum(not o.killed for o in outcomes)} survived in {seconds:.1f} s "
          f"({args.jobs} processes)")
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(outcomes, rows, seconds, args.jobs,
                                                      failures), indent=1) + "\n")
    return 1 if failures or any(not o.killed for o in outcomes) else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="files (default: std/ without primitives)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--kind", action="append", choices=KINDS,
                        help="only this kind of mutant (repeatable)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
