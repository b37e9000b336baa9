"""Run the TextMate grammar tests (vscode-tmgrammar-test, installed by `make setup`).

    python tests/grammar/run_grammar_tests.py              # syntax tests + snapshots
    python tests/grammar/run_grammar_tests.py unit         # tests/grammar/*.test.module
    python tests/grammar/run_grammar_tests.py snap         # snapshots of std/ and examples/
    python tests/grammar/run_grammar_tests.py snap --update   # rewrite the snapshots

Syntax tests: tests/grammar/*.test.module, in the tool's format (a `# SYNTAX TEST
"source.module"` header, then `#  ^^^ scope` lines asserting the scopes of the source line
above them; `# <--- scope` for the first columns).

Snapshots: every `.module` file of std/ and examples/ is tokenized and compared with its
snapshot, tests/grammar/snap/<path>.snap. The tool keeps a snapshot next to its source, so
the sources and snapshots are copied to a scratch folder first. A source without a
snapshot, or a snapshot without a source, fails (the tool itself would silently create
the snapshot); `--update` writes them. A snapshot holds the source text too, so editing a
std/ or examples/ file means updating its snapshot: review the diff, then `--update`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GRAMMAR = REPO / "grammar" / "module.tmLanguage.json"
TOOL = REPO / "editors" / "vscode" / "node_modules" / "vscode-tmgrammar-test" / "dist"
SYNTAX_TESTS = REPO / "tests" / "grammar"
SNAPSHOTS = REPO / "tests" / "grammar" / "snap"
SNAPSHOT_SOURCES = ("std", "examples")
SETUP_HINT = ("vscode-tmgrammar-test is not installed: run `make setup` "
              "(npm install --prefix editors/vscode)")


class Missing(Exception):
    """node or the npm package is not there."""


def node() -> str:
    found = shutil.which("node")
    if found is None:
        raise Missing("node is not installed")
    return found


def tool(name: str) -> Path:
    script = TOOL / f"{name}.js"
    if not script.is_file():
        raise Missing(SETUP_HINT)
    return script


def snapshot_sources() -> list[Path]:
    """Paths relative to the repository, sorted."""
    return sorted(path.relative_to(REPO) for folder in SNAPSHOT_SOURCES
                  for path in (REPO / folder).rglob("*.module"))


def run_unit() -> tuple[int, str]:
    tests = sorted(SYNTAX_TESTS.glob("*.test.module"))
    if not tests:
        return 1, f"no syntax tests in {SYNTAX_TESTS}"
    command = [node(), str(tool("unit")), "-g", str(GRAMMAR), *map(str, tests)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def run_snap(update: bool = False) -> tuple[int, str]:
    sources = snapshot_sources()
    expected = {SNAPSHOTS / f"{source}.snap" for source in sources}
    stale = sorted(set(SNAPSHOTS.rglob("*.snap")) - expected)
    missing = sorted(path for path in expected if not path.is_file())
    messages = []
    if not update and (stale or missing):
        messages += [f"snapshot without a source: {p.relative_to(REPO)}" for p in stale]
        messages += [f"no snapshot for {p.relative_to(SNAPSHOTS).with_suffix('')}" for p in missing]
        messages.append("run `python tests/grammar/run_grammar_tests.py snap --update` "
                        "and review the new snapshots")
        return 1, "\n".join(messages)
    with tempfile.TemporaryDirectory(prefix="module-snap-") as scratch:
        root = Path(scratch)
        for source in sources:
            copy = root / source
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / source, copy)
            snapshot = SNAPSHOTS / f"{source}.snap"
            if snapshot.is_file():
                shutil.copyfile(snapshot, root / f"{source}.snap")
        command = [node(), str(tool("snapshot")), "-g", str(GRAMMAR), "-s", "source.module",
                   "--expandDiff", *(["--updateSnapshot"] if update else []),
                   *(str(source) for source in sources)]
        done = subprocess.run(command, cwd=root, capture_output=True, text=True)
        output = done.stdout + done.stderr
        if update and done.returncode == 0:
            for path in stale:
                path.unlink()
                messages.append(f"removed {path.relative_to(REPO)}")
            for source in sources:
                target = SNAPSHOTS / f"{source}.snap"
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(root / f"{source}.snap", target)
            messages.append(f"wrote {len(sources)} snapshots under {SNAPSHOTS.relative_to(REPO)}")
    return done.returncode, "\n".join([output, *messages]).strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="?", choices=("all", "unit", "snap"), default="all")
    parser.add_argument("--update", action="store_true", help="rewrite the snapshots")
    args = parser.parse_args(argv)
    status = 0
    try:
        if args.which in ("all", "unit"):
            code, output = run_unit()
            print(output)
            status |= code != 0
        if args.which in ("all", "snap"):
            code, output = run_snap(args.update)
            print(output)
            status |= code != 0
    except Missing as missing:
        print(missing, file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
