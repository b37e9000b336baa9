"""Hover and go-to-definition over an `Analysis`. Positions are 1-based (line, column) in
characters, as in `Span`; the server converts from and to LSP positions."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import NamedTuple

from modulec.lsp.analysis import Analysis
from modulec.source import Span
from modulec.syntax import ast as A

_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


class Word(NamedTuple):
    """The identifier under the cursor; `parts`: the dotted name up to and including it."""

    name: str
    parts: tuple[str, ...]
    span: Span


def word_at(analysis: Analysis, line: int, column: int) -> Word | None:
    source = analysis.source
    text = source.line_text(line)
    for match in _DOTTED.finditer(text):
        if match.start() < column <= match.end() + 1:  # the end counts: a cursor after it
            start = match.start()
            parts: list[str] = []
            for part in match.group().split("."):
                parts.append(part)
                if column <= start + len(part) + 1:
                    break
                start += len(part) + 1
            offset = source.offset(line, start + 1)
            return Word(parts[-1], tuple(parts), source.span(offset, offset + len(parts[-1])))
    return None


# ====================================================================== hover
def hover(analysis: Analysis, line: int, column: int) -> str | None:
    """Markdown: a tensor's inferred shape, a parameter's value, or a declaration."""
    word = word_at(analysis, line, column)
    if word is None:
        return None
    decl, instance = _enclosing(analysis, word.span)
    if instance is not None and len(word.parts) == 1:
        tensor = _tensor(instance, word)
        if tensor is not None:
            phase, name, type_, _ = tensor
            return _code(f"{name}: {type_}") + f"\n\n{phase} tensor"
        if word.name in instance.params:
            from modulec.check.resolved import _param

            return _code(f"{word.name}: {_param(instance.params[word.name])}") + "\n\nparameter"
    binding = _binding(analysis, word)
    if binding is not None:
        from modulec.syntax.printer import decl_header

        doc = binding.decl.docstring
        text = _code(decl_header(binding.decl)) + f"\n\n`{binding.module_path}`"
        return text + (f"\n\n{_dedent(doc.value)}" if doc is not None else "")
    param = next((p for p in decl.params or () if p.name == word.name), None) \
        if decl is not None and len(word.parts) == 1 else None
    if param is not None:
        from modulec.syntax.printer import decl_param

        return _code(decl_param(param)) + f"\n\nparameter of `{decl.name}`"
    if instance is not None and word.name in instance.values:
        return _code(f"{word.name} = {instance.values[word.name]}")
    declared = _declared(decl, word.name) if decl is not None else None
    if declared is not None and declared[1] is not None:
        from modulec.syntax.printer import expr

        return _code(f"{word.name}: {expr(declared[1])}")
    return None


def _code(text: str) -> str:
    return f"```module\n{text}\n```"


def _dedent(text: str) -> str:
    import inspect

    return inspect.cleandoc(text)


# ====================================================================== definition
def definition(analysis: Analysis, line: int, column: int) -> list[tuple[Path, Span]]:
    """Where the name under the cursor is declared: (file, span) pairs, maybe several."""
    word = word_at(analysis, line, column)
    if word is None:
        return []
    statement = _import_at(analysis, word.span)
    if statement is not None:
        files = _module_files(analysis, ".".join(word.parts))
        if files:
            return files
    binding = _binding(analysis, word)
    if binding is not None:
        return [(binding.file, binding.decl.name_span)]
    decl, instance = _enclosing(analysis, word.span)
    if decl is None or len(word.parts) != 1:
        return []
    declared = _declared(decl, word.name)
    if declared is not None:
        return [(analysis.path, declared[0])]
    tensor = _tensor(instance, word) if instance is not None else None
    return [(analysis.path, tensor[3])] if tensor is not None else []


def _module_files(analysis: Analysis, dotted: str) -> list[tuple[Path, Span]]:
    """The imported files named by a module path (a folder: each of its files)."""
    found = {m.path: m for m in analysis.resolved.dependencies
             if m.module_path == dotted or m.module_path.startswith(dotted + ".")}
    return [(path, Span(str(path), 0, 0, 1, 1, 1, 1)) for path in sorted(found)]


# ====================================================================== lookups
def _binding(analysis: Analysis, word: Word):
    return analysis.resolved.scope.lookup_qualified(word.parts, word.span)


def _import_at(analysis: Analysis, span: Span):
    for item in analysis.program.items if analysis.program is not None else ():
        if isinstance(item, (A.Import, A.FromImport)) and _inside(span, item.span):
            return item
    return None


def _enclosing(analysis: Analysis, span: Span):
    """The declaration around `span`, and its checked instance (None after errors)."""
    for decl in analysis.program.decls if analysis.program is not None else ():
        if _inside(span, decl.span):
            instance = next((i for i in analysis.instances if i.definition.decl is decl), None)
            return decl, instance
    return None, None


def _tensor(instance, word: Word):
    """The inferred (phase, name, type, span) of `word`: its definition at the cursor, else
    the last one before it (a use), else the first (a use before, in backward)."""
    entries = [e for e in instance.inferred if e[1] == word.name]
    here = [e for e in entries if _inside(word.span, e[3])]
    before = [e for e in entries if e[3].start <= word.span.start]
    return (here or before[-1:] or entries[:1] or [None])[0]


def _declared(decl: A.Decl, name: str):
    """(span, type or None) where `decl` declares `name`: a parameter of the declaration,
    a `params:`/`let:` entry, or a graph input or output (`in: x: [B, T, d]`)."""
    for param in decl.params or ():
        if param.name == name:
            return param.span, param.type
    for node in _walk(decl.body):
        if isinstance(node, A.Entry) and isinstance(node.key, A.Name) and node.key.id == name:
            return node.key.span, None if isinstance(node.value, A.NamedValue) else node.value
        if isinstance(node, (A.NamedValue, A.Element)) and node.name == name:
            return node.span, node.value
    return None


def _walk(node):
    if isinstance(node, tuple):
        for child in node:
            yield from _walk(child)
    elif dataclasses.is_dataclass(node) and not isinstance(node, Span):
        yield node
        for f in dataclasses.fields(node):
            yield from _walk(getattr(node, f.name))


def _inside(inner: Span, outer: Span) -> bool:
    return outer.start <= inner.start and inner.end <= outer.end
