"""The code blocks of the language spec that are DSL source, for tests and benchmarks.

A block counts when its fence has no language tag and its first line that is neither blank
nor a comment starts a declaration, an import or a docstring. The §2.3 keyword table is
left out. Blocks with `...` (elided bodies) are placeholders, not complete declarations.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "docs" / "spec" / "module-dsl-spec.md"

STARTS = ("module", "abstract", "block", "model", "primitive", "import", "from", "recipe", '"""')
KEYWORD_TABLE = "module    block"

Block = tuple[int, str]  # (1-based line of the first code line, text)


def _fenced_blocks(lines: list[str]) -> list[tuple[str, int, list[str]]]:
    """(language tag, first code line number, code lines) of every fenced block."""
    blocks, inside, tag, start, body = [], False, "", 0, []
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if not inside and stripped.startswith("```"):
            inside, tag, start, body = True, stripped[3:].strip(), number + 1, []
        elif inside and stripped == "```":
            blocks.append((tag, start, body))
            inside = False
        elif inside:
            body.append(line)
    return blocks


def _first_code_line(body: list[str]) -> str:
    for line in body:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            return stripped
    return ""


def _is_dsl(tag: str, body: list[str]) -> bool:
    first = _first_code_line(body)
    if tag or first.startswith(KEYWORD_TABLE):
        return False
    return first.startswith(STARTS)


@lru_cache(maxsize=1)
def dsl_blocks() -> tuple[Block, ...]:
    lines = SPEC.read_text(encoding="utf-8").splitlines()
    return tuple((start, "\n".join(body) + "\n")
                 for tag, start, body in _fenced_blocks(lines) if _is_dsl(tag, body))


def declaration_blocks() -> list[Block]:
    """Complete examples: no `...` anywhere."""
    return [block for block in dsl_blocks() if "..." not in block[1]]


def placeholder_blocks() -> list[Block]:
    """Examples with elided parts (`...`)."""
    return [block for block in dsl_blocks() if "..." in block[1]]


if __name__ == "__main__":
    print(len(declaration_blocks()), "declaration blocks,",
          len(placeholder_blocks()), "placeholder blocks")
