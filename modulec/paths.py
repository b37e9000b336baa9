"""Where the grammar and the standard library live, in a checkout or an installed package."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent


def data_dir(name: str) -> Path:
    """`grammar` or `std`: the packaged copy if there is one, else the checkout's folder."""
    packaged = PACKAGE_DIR / "_data" / name
    return packaged if packaged.is_dir() else REPO_DIR / name


def grammar_file() -> Path:
    return data_dir("grammar") / "module.lark"
