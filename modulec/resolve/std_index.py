"""Which standard-library module declares a name, for the help of an undefined module or
operation: `Linear` -> `import std.modules.linear.Linear`. Read on the error path only
(once per process); the primitives are always in scope and are not listed."""

from __future__ import annotations

from functools import lru_cache

from modulec.paths import data_dir


@lru_cache(maxsize=1)
def std_declarations() -> dict[str, str]:
    """name -> dotted module path, for every declaration of std/ outside primitives/."""
    from modulec.source import SourceFile
    from modulec.syntax.parser import parse_source

    root = data_dir("std").resolve()
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.module")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] == "primitives" or "." in parts[-1]:  # a versioned file: the plain one
            continue
        try:
            program = parse_source(SourceFile(str(path), path.read_text(encoding="utf-8")),
                                   True).program
        except (OSError, UnicodeDecodeError):
            continue
        for decl in program.decls if program is not None else ():
            found.setdefault(decl.name, ".".join(("std", *parts)))
    return found


def import_help(name: str) -> list[str]:
    """`add `import std.modules.linear.Linear`` when the standard library declares `name`."""
    module = std_declarations().get(name)
    if module is None:
        return []
    return [f"`{name}` is declared in `{module}`: add `import {module}.{name}` "
            f"(or `from {module} import {name}`) at the top of the file"]
