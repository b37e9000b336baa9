"""UI tests (rustc's, adapted): a `.module` file states the diagnostics it must produce in
comment lines of carets under the line they point at. The format is described in
tests/ui/README.md; in short:

    module M():
      forward:
        graph:
          hidden -> relu() -> hiden2
    #                         ^^^^^^ E002: undefined name

`check_file(path)` runs `modulec check --format json` in-process and compares the primary
spans and codes it reports with the annotations (as multisets, plus the message fragments);
`bless(path, outcome)` rewrites a file's annotations from what the compiler reported.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

# `#` then either carets touching it (the `#` is the first caret), or spaces and then carets,
# a zero-width mark `^!`, or explicit columns `@START..END`, or `?` (a diagnostic whose
# primary span is not in this file); then the code and an optional `: fragment`.
ANNOTATION = re.compile(r"""
    ^(?P<lead>[ \t]*)\#
    (?: (?P<touch>\^+) | (?P<elsewhere>\?)
      | (?P<gap>\ +) (?: (?P<carets>\^+)(?P<zero>!)? | @(?P<c1>\d+)\.\.(?P<c2>\d+) )
    )
    \ +(?P<code>[EW]\d{3})
    (?:\ *:(?P<fragment>.*))?
    \s*$""", re.X)
# A comment line that starts like an annotation is one, and must then be well-formed.
LOOKS_LIKE_ANNOTATION = re.compile(r"^[ \t]*#(?:\^|\?| +\^| +@\d)")
HEADER = re.compile(r"^#\s*(?P<key>[a-z][a-z0-9-]*)\s*:\s*(?P<value>.*?)\s*$")
LEGEND = "(- expected by an annotation, not emitted; + emitted, not expected)"
TAB_SHOWN_AS = "\u2192"  # one character, so caret columns stay aligned under the line


class AnnotationError(Exception):
    """The test file itself is malformed."""


@dataclass(frozen=True)
class Expected:
    line: int | None  # 1-based line the annotation refers to; None for `#?` (elsewhere)
    start: int      # 1-based start column
    end: int        # exclusive end column (== start for a zero-width span)
    code: str
    fragment: str | None
    at: int         # line of the annotation itself

    @property
    def key(self):
        return (self.line, self.start, self.end, self.code)


@dataclass(frozen=True)
class Actual:
    line: int | None  # None: no primary span in this file
    start: int
    end: int
    code: str
    level: str
    message: str
    where: str = ""   # for a diagnostic not located in this file: where it is

    @property
    def key(self):
        return (self.line, self.start, self.end, self.code)


@dataclass
class TestFile:
    path: Path
    lines: list[str]
    header: list[tuple[str, str]]
    expected: list[Expected]
    annotation_lines: set[int]   # 1-based

    def cli_args(self) -> list[str]:
        """Options from the header: `path: DIR` (relative to the file), `args: ...` (split
        like a shell), any other `key: value` as `--key value` (`command:` is not an
        option: it picks the command, see `command`)."""
        args: list[str] = []
        for key, value in self.header:
            if key == "command":
                continue
            if key == "args":
                args += shlex.split(value)
            elif key == "path":
                args += ["--path", str((self.path.parent / value).resolve())]
            else:
                args += [f"--{key}", value]
        return args

    @property
    def command(self) -> str:
        """`check`, or `build` for diagnostics that only a build reports (`# command:
        build`: the fuse pass's E013 needs the model lowered at concrete sizes)."""
        return next((v for k, v in self.header if k == "command"), "check")


@dataclass
class Outcome:
    test: TestFile
    exit_code: int
    actual: list[Actual]
    matched: list[tuple[Expected, Actual]] = field(default_factory=list)
    missing: list[Expected] = field(default_factory=list)
    unexpected: list[Actual] = field(default_factory=list)
    problem: str = ""   # the run itself went wrong (crash, usage error, bad JSON)

    @property
    def ok(self) -> bool:
        return not (self.problem or self.missing or self.unexpected)

    def report(self) -> str:
        if self.problem:
            return f"{self.test.path}: {self.problem}"
        return render_diff(self)


# ============================================================================ parsing
def parse_test_file(path: Path) -> TestFile:
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()   # the text after the final newline is not a line of its own
    lines = [line.rstrip("\r") for line in lines]
    expected: list[Expected] = []
    annotation_lines: set[int] = set()
    target = 0
    for number, line in enumerate(lines, 1):
        annotation = parse_annotation(line, number, target, path)
        if annotation is None:
            target = number
            continue
        annotation_lines.add(number)
        expected.append(annotation)
    return TestFile(Path(path), lines, parse_header(lines), expected, annotation_lines)


def parse_annotation(line: str, number: int, target: int, path) -> Expected | None:
    if not LOOKS_LIKE_ANNOTATION.match(line):
        return None
    m = ANNOTATION.match(line)
    where = f"{path}:{number}"
    if m is None:
        raise AnnotationError(
            f"{where}: malformed annotation {line.strip()!r}; write `#  ^^^ CODE: fragment` "
            "(see tests/ui/README.md)")
    fragment = (m["fragment"] or "").strip() or None
    if m["elsewhere"]:
        return Expected(None, 0, 0, m["code"], fragment, number)
    if target == 0:
        raise AnnotationError(f"{where}: an annotation needs a line above it to point at")
    hash_column = len(m["lead"]) + 1
    if m["touch"]:
        start, end = hash_column, m.end("touch") + 1
    elif m["carets"]:
        start, end = m.start("carets") + 1, m.end("carets") + 1
        if m["zero"]:
            if len(m["carets"]) != 1:
                raise AnnotationError(f"{where}: `!` (zero width) follows a single `^`")
            end = start
    else:
        start, end = int(m["c1"]), int(m["c2"])
        if not 1 <= start <= end:
            raise AnnotationError(f"{where}: explicit columns need 1 <= START <= END")
    return Expected(target, start, end, m["code"], fragment, number)


def parse_header(lines: list[str]) -> list[tuple[str, str]]:
    """`# key: value` lines of the comment block at the top of the file (blank lines may
    separate them; the first other line ends the header)."""
    header = []
    for line in lines:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        m = HEADER.match(stripped)
        if m and not LOOKS_LIKE_ANNOTATION.match(stripped):
            header.append((m["key"], m["value"]))
    return header


# ============================================================================ running
def run_check(path: Path, extra_args: list[str], command: str = "check"
              ) -> tuple[int, str, str]:
    """`modulec check --format json [ARGS] FILE` (or `build`) in-process: (exit code,
    stdout, stderr)."""
    from click.testing import CliRunner

    from modulec.cli.main import modulec

    result = CliRunner().invoke(modulec, [command, "--format", "json", *extra_args, str(path)])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def actual_diagnostics(test: TestFile, stdout: str) -> list[Actual]:
    found = []
    for text in stdout.splitlines():
        if text.strip():
            found.append(to_actual(json.loads(text), test))
    return found


def to_actual(d: dict, test: TestFile) -> Actual:
    primary = [s for s in d.get("spans", []) if s.get("is_primary")]
    code, level, message = d.get("code") or "", d.get("level", ""), d.get("message", "")
    if not primary:
        return Actual(None, 0, 0, code, level, message, "(no span)")
    span = primary[0]
    if span["file_name"] != str(test.path):
        where = f"{span['file_name']}:{span['line_start']}:{span['column_start']}"
        return Actual(None, 0, 0, code, level, message, where)
    line, start = span["line_start"], span["column_start"]
    if span["line_end"] == line:
        end = span["column_end"]
    else:  # several lines: the first line's columns, from the start to the end of that line
        text = test.lines[line - 1] if line <= len(test.lines) else ""
        end = max(len(text) + 1, start + 1)
    return Actual(line, start, end, code, level, message)


def check_file(path: Path) -> Outcome:
    test = parse_test_file(path)
    exit_code, stdout, stderr = run_check(test.path, test.cli_args(), test.command)
    if exit_code not in (0, 1):
        return Outcome(test, exit_code, [], problem=(
            f"`modulec {test.command}` exited with status {exit_code}\n{stderr}{stdout}"))
    try:
        actual = actual_diagnostics(test, stdout)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return Outcome(test, exit_code, [], problem=f"bad JSON output ({exc}):\n{stdout}")
    outcome = Outcome(test, exit_code, actual)
    has_errors = any(a.level == "error" for a in actual)
    if exit_code != (1 if has_errors else 0):
        outcome.problem = (f"exit status {exit_code} does not fit the diagnostics "
                           f"({'some' if has_errors else 'no'} errors)")
    match(outcome)
    return outcome


def match(outcome: Outcome) -> None:
    """Pair expectations with diagnostics: same line, columns and code, and the message
    contains the fragment. A maximum bipartite matching, so the order of annotations for
    one span never matters."""
    expected, actual = outcome.test.expected, outcome.actual
    fits = [[j for j, a in enumerate(actual)
             if a.key == e.key and (e.fragment is None or e.fragment in a.message)]
            for e in expected]
    owner: dict[int, int] = {}   # actual index -> expected index

    def augment(i: int, seen: set[int]) -> bool:
        for j in fits[i]:
            if j not in seen:
                seen.add(j)
                if j not in owner or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    for i in range(len(expected)):
        augment(i, set())
    paired = {i: j for j, i in owner.items()}
    outcome.matched = [(expected[i], actual[j]) for i, j in sorted(paired.items())]
    outcome.missing = [e for i, e in enumerate(expected) if i not in paired]
    outcome.unexpected = [a for j, a in enumerate(actual) if j not in owner]


# ============================================================================ reporting
def caret_text(start: int, end: int) -> str:
    """Marks under a line, in the annotations' own notation (columns are literal here)."""
    return " " * (start - 1) + ("^!" if end == start else "^" * (end - start))


def render_diff(outcome: Outcome, context: int = 2) -> str:
    test = outcome.test
    rows: dict[int, list[tuple[str, int, int, str]]] = {}
    for e, a in outcome.matched:
        if e.line is not None:
            rows.setdefault(e.line, []).append((" ", e.start, e.end, _label(e.code, a.message)))
    elsewhere = []
    for e in outcome.missing:
        text = e.code + (f": {e.fragment}" if e.fragment else "")
        if e.line is None:
            elsewhere.append(f"- (not in this file) {text}")
        else:
            rows.setdefault(e.line, []).append(("-", e.start, e.end, text))
    for e, a in outcome.matched:
        if e.line is None:
            elsewhere.append(f"  {a.where} {_label(a.code, a.message)}")
    for a in outcome.unexpected:
        if a.line is not None:
            rows.setdefault(a.line, []).append(("+", a.start, a.end, _label(a.code, a.message)))
    gutter = len(str(len(test.lines)))
    shown = {n for line in rows for n in range(line - context, line + context + 1)}
    out = [f"{test.path}: the diagnostics differ from the annotations", LEGEND, ""]
    skipped = False
    for number, text in enumerate(test.lines, 1):
        if number in test.annotation_lines and number not in rows:
            continue
        if number not in shown:
            if not skipped:
                out.append(" " * (gutter + 1) + "...")
            skipped = True
            continue
        skipped = False
        out.append(f" {number:>{gutter}} | {text.replace(chr(9), TAB_SHOWN_AS)}")
        for sign, start, end, label in sorted(rows.get(number, []),
                                              key=lambda r: (r[1], r[2], r[0])):
            out.append(f"{sign}{'':>{gutter}} | {caret_text(start, end)} {label}")
    for number in sorted(n for n in rows if n > len(test.lines)):  # the end of the file
        out.append(f" {number:>{gutter}} | (end of file)")
        for sign, start, end, label in rows[number]:
            out.append(f"{sign}{'':>{gutter}} | {caret_text(start, end)} {label}")
    out += elsewhere
    for a in outcome.unexpected:
        if a.line is None:
            out.append(f"+ {a.where} {_label(a.code, a.message)}")
    out += ["", "annotations for the unexpected diagnostics:", *_blessed_lines(outcome),
            "", "(MODULEC_BLESS=1 rewrites the file's annotations from the actual diagnostics)"]
    return "\n".join(out)


def _label(code: str, message: str) -> str:
    return f"{code or '(no code)'}: {message}"


def _blessed_lines(outcome: Outcome) -> list[str]:
    notes = []
    for a in sorted(outcome.unexpected, key=lambda a: (a.line or 0, a.start, a.end)):
        if a.line is None:
            notes.append(f"  anywhere: {elsewhere_text(a.code, a.message)}   ({a.where})")
        elif a.line > len(outcome.test.lines):
            notes.append(f"  (cannot annotate {a.code} at the end of the file, line {a.line})")
        else:
            notes.append(f"  line {a.line}: {annotation_text(a.start, a.end, a.code, a.message)}")
    return notes or ["  (none to add; remove the `-` annotations)"]


# ============================================================================ blessing
def annotation_text(start: int, end: int, code: str, fragment: str | None) -> str:
    """The annotation line for a span starting on the line above (the `#` in column 1)."""
    if start >= 3:   # room for `#`, a space, then the carets at their columns
        mark = "#" + " " * (start - 2) + ("^!" if end == start else "^" * (end - start))
    elif start == 1 and end >= 3:   # the `#` is the first caret
        mark = "#" + "^" * (end - 2)
    else:
        mark = f"# @{start}..{end}"
    return mark + f" {code}" + (f": {fragment}" if fragment else "")


def _first_line(a: Actual) -> str:
    return a.message.splitlines()[0] if a.message else ""


def elsewhere_text(code: str, fragment: str | None) -> str:
    """The annotation line for a diagnostic whose primary span is not in the file."""
    return f"#? {code}" + (f": {fragment}" if fragment else "")


def bless(outcome: Outcome) -> str:
    """Rewrite the file's annotations from the actual diagnostics (an annotation that
    matched keeps its fragment; `#?` lines go at the end of the file). Returns the new
    text; raises when a diagnostic lies past the last line."""
    test = outcome.test
    kept = {id(a): e.fragment for e, a in outcome.matched}
    by_line: dict[int, list[Actual]] = {}
    for a in outcome.actual:
        by_line.setdefault(a.line, []).append(a)
    out = []
    for number, text in enumerate(test.lines, 1):
        if number in test.annotation_lines:
            continue
        out.append(text)
        for a in sorted(by_line.get(number, []), key=lambda a: (a.start, a.end, a.code)):
            fragment = kept[id(a)] if id(a) in kept else _first_line(a)
            out.append(annotation_text(a.start, a.end, a.code, fragment))
    for a in by_line.pop(None, []):
        out.append(elsewhere_text(a.code, kept[id(a)] if id(a) in kept else _first_line(a)))
    if any(line > len(test.lines) or line in test.annotation_lines for line in by_line):
        raise AnnotationError(f"{test.path}: cannot bless a diagnostic past the last line "
                              "or on an annotation line")
    new_text = "\n".join(out) + "\n"
    test.path.write_text(new_text, encoding="utf-8")
    return new_text
