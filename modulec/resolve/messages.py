"""The resolver's diagnostics, worded in one place."""

from __future__ import annotations

import os
from pathlib import Path

from modulec.diagnostics import Diagnostic, Label, error, warning
from modulec.diagnostics.spelling import edit_distance
from modulec.resolve.locate import Miss, Root
from modulec.source import Span

MAX_GUESSES = 4


def cannot_find(parts: tuple[str, ...], miss: Miss, span: Span, roots: list[Root],
                std_hint: str | None) -> Diagnostic:
    """E002 at the path segment that failed, with "did you mean" and the roots searched.
    `parts` is the path as far as it matters (a statement's path, or path and item)."""
    dotted = ".".join(parts)
    if miss.escape is not None:
        return escapes(dotted, miss, span, roots)
    segment = parts[min(miss.segment, len(parts) - 1)]
    where = ".".join(parts[:miss.segment])
    label = f"no `{segment}` in `{where}`" if where else "not found in any search root"
    guesses = closest(segment, miss.candidates)
    helps = [f"did you mean {or_list(guesses)}?"] if guesses else []
    if std_hint:
        helps.append(f"the standard library has it: `{std_hint}`")
    searched = "searched: " + ", ".join(root.describe() for root in roots)
    return error("E002", f"cannot find module path `{dotted}`", span, label,
                 notes=[*miss.notes, searched], help=helps)


def escapes(dotted: str, miss: Miss, span: Span, roots: list[Root]) -> Diagnostic:
    target = miss.escape.resolve()
    root = next((r for r in roots if miss.escape.is_relative_to(r.path)), None)
    inside = f"the search root {root.path}" if root else "its search root"
    return error("E002", f"cannot find module path `{dotted}`", span,
                 "leads outside its search root",
                 notes=[f"{miss.escape} is a link to {target}, outside {inside}",
                        "import paths never escape the search roots"],
                 help=["copy the file into the search root, or add its folder with --path"])


def declared_twice(dotted: str, name: str, files: tuple[Path, ...], span: Span) -> Diagnostic:
    shown = " and ".join(f"`{f.name}`" for f in files[:2])
    folder = dotted.rsplit(".", 1)[0]
    return error("E023", f"`{dotted}` is ambiguous: `{name}` is declared in {shown}", span,
                 "declared in more than one file of this folder",
                 notes=[f"files: {', '.join(str(f) for f in files)}"],
                 help=[f"import it from its file: `import {folder}.{files[0].stem.split('.')[0]}"
                       f".{name}`"])


def imported_twice(name: str, span: Span, first: Span, origin: str,
                   other: str) -> Diagnostic:
    renamed = f"{origin.rsplit('.', 1)[-1]}_{name}"
    return error("E023", f"`{name}` is imported twice, from `{other}` and `{origin}`", span,
                 f"`{name}` imported again here", secondary=[Label(first, "first imported here")],
                 help=[f"rename one with `as`, e.g. `{name} as {renamed}`"])


def ambiguous(name: str, span: Span, sources: list[tuple[Span, str]]) -> Diagnostic:
    """E023 at a lookup of a name that several whole-module imports bring in."""
    origins = " and ".join(f"`{module}`" for _, module in sources[:2])
    return error("E023", f"`{name}` is ambiguous: both {origins} declare it", span,
                 "ambiguous name",
                 secondary=[Label(s, f"`{name}` from `{module}`") for s, module in sources],
                 help=[f"import the one you mean by name (`import {sources[0][1]}.{name}`), "
                       f"or write it qualified (`{sources[0][1]}.{name}`)"])


def alias_shadows(alias: str, span: Span, existing: Span, what: str) -> Diagnostic:
    return error("E024", f"import alias `{alias}` shadows {what}", span,
                 "alias already in use", secondary=[Label(existing, f"`{alias}` defined here")],
                 help=["choose an alias that is not used in this file"])


def local_shadows_import(name: str, span: Span, imported: Span, module: str) -> Diagnostic:
    return warning("W002", f"declaration `{name}` shadows the name imported from `{module}`",
                   span, "this declaration wins",
                   secondary=[Label(imported, f"`{name}` imported here")],
                   help=["rename the declaration, or import the other one under an alias"])


def shadows_primitive(name: str, span: Span, primitive_module: str) -> Diagnostic:
    return warning("W001", f"declaration `{name}` shadows the primitive `{name}`", span,
                   "this declaration wins over the primitive",
                   notes=[f"the primitive is declared in `{primitive_module}`"],
                   help=["rename the declaration to keep the primitive usable unqualified"])


def circular(span: Span, chain: list[Path]) -> Diagnostic:
    return error("E007", "circular import", span, "imports a file that imports this one",
                 notes=["import chain: " + " -> ".join(_short(chain))],
                 help=["move the shared declarations into a file that both can import"])


def alias_with_braces(span: Span) -> Diagnostic:
    return error("E001", "`as` cannot rename a `{...}` import list", span, "alias not allowed",
                 help=["rename the items instead: `import a.b.{C as X}`"])


def closest(name: str, candidates, limit: int = MAX_GUESSES) -> list[str]:
    """Up to `limit` candidates nearest to `name` by edit distance (close enough to help)."""
    threshold = max(1, len(name) // 3)
    scored = sorted((edit_distance(name.lower(), c.lower()), c) for c in set(candidates))
    return [c for d, c in scored if d <= threshold and d < len(name) and c != name][:limit]


def or_list(names: list[str]) -> str:
    quoted = [f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def _short(chain: list[Path]) -> list[str]:
    """The chain's files relative to their common folder."""
    common = Path(os.path.commonpath([str(p.parent) for p in chain]))
    return [str(p.relative_to(common)) for p in chain]
