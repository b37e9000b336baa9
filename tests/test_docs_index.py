"""docs/decisions.md opens with an index of its topics (every `## ` heading, alphabetical,
each a link to its section) so a reader finds a decision in seconds. A new section needs a
line there: `python tests/test_docs_index.py` rewrites the index from the headings."""

from __future__ import annotations

import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "decisions.md"
START = "<!-- index: every `## ` topic below, alphabetical (tests/test_docs_index.py) -->\n"
END = "<!-- /index -->\n"


def anchor(heading: str, seen: dict[str, int]) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens;
    a repeated one gets -1, -2, ..."""
    base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    count = seen.get(base, 0)
    seen[base] = count + 1
    return base if count == 0 else f"{base}-{count}"


def expected_index(text: str) -> str:
    body = text.split(END, 1)[-1]
    seen: dict[str, int] = {}
    links = [(h, anchor(h, seen)) for h in re.findall(r"^## (.+)$", body, re.M)]
    lines = sorted((f"- [{h}](#{a})" for h, a in links),
                   key=lambda line: line.replace("`", "").lower())
    return START + "\n".join(lines) + "\n" + END


def current_index(text: str) -> str:
    return START + text.split(START, 1)[1].split(END, 1)[0] + END


def test_the_index_lists_every_topic():
    text = PAGE.read_text(encoding="utf-8")
    assert START in text and END in text, "docs/decisions.md has lost its index markers"
    assert current_index(text) == expected_index(text), \
        "docs/decisions.md's index is out of date: run `python tests/test_docs_index.py`"


if __name__ == "__main__":  # rewrite the index from the headings
    page = PAGE.read_text(encoding="utf-8")
    PAGE.write_text(page.replace(current_index(page), expected_index(page)), encoding="utf-8")
    sys.exit(0)
