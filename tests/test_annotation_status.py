"""The annotation status table (modulec/check/annotation_status.py): every annotation says
what it does on each backend; what acts names the code that does it (and that code exists);
what has no effect yet is warned about (W006) in a UI test; docs/annotations.md is the
table's page as generated."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ui_harness
from modulec.check.annotation_doc import annotations_page
from modulec.check.annotation_status import ACTS, NO_EFFECT, REFUSED, STATUS
from modulec.check.annotation_table import ANNOTATIONS

ROOT = Path(__file__).resolve().parent.parent
NO_EFFECT_UI = ROOT / "tests" / "ui" / "annotations" / "w006_no_effect_yet.module"
PAGE = ROOT / "docs" / "annotations.md"


def effects():
    """(what, effect, is a part) of every entry: each annotation and each of its parts."""
    for name, spec in ANNOTATIONS.items():
        yield f"`@{name}`", spec.status.effect, False
        for part in spec.status.parts:
            yield part.describe(name), part.effect, True


def test_every_annotation_has_a_status_and_every_status_an_annotation():
    assert set(STATUS) == set(ANNOTATIONS)
    assert all(spec.status is STATUS[name] for name, spec in ANNOTATIONS.items())


@pytest.mark.parametrize("what, effect", [(w, e) for w, e, _ in effects()],
                         ids=[w for w, _, _ in effects()])
def test_a_status_is_acts_no_effect_or_refused_and_what_acts_names_its_code(what, effect):
    assert {effect.cpu, effect.gpu} <= {ACTS, NO_EFFECT, REFUSED}
    if ACTS in (effect.cpu, effect.gpu):
        assert effect.by, f"{what} acts: name the code that implements it (`by`)"
    for reference in effect.by:
        assert defined(reference), f"{what}: `{reference}` is not defined"


def defined(reference: str) -> bool:
    """Whether "package.module:Name" or "package.module:Class.method" is defined in that
    module's source (read, not imported: the GPU modules need CUDA)."""
    module, _, qualname = reference.partition(":")
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.is_file():
        return False
    scope = ast.parse(path.read_text(encoding="utf-8")).body
    for name in qualname.split("."):
        found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                 and n.name == name]
        if not found:
            return False
        scope = found[0].body
    return True


def test_the_reference_check_catches_a_missing_name():
    assert defined("modulec.lower.value_marks:mark")
    assert not defined("modulec.lower.value_marks:no_such_function")
    assert not defined("runtime.hooks:Hooks.no_such_method")


def test_every_annotation_without_effect_is_warned_about_in_the_ui_test():
    """What has no effect on a backend must give W006 (the UI test file runs in
    tests/test_ui.py and there emits exactly the W006s it expects)."""
    warned = [e.fragment.strip() for e in ui_harness.parse_test_file(NO_EFFECT_UI).expected
              if e.code == "W006"]
    silent = [what for what, effect, _ in effects() if effect.missing()
              and not any(fragment.startswith(f"{what} has no effect") for fragment in warned)]
    assert not silent, f"no W006 expected in {NO_EFFECT_UI.name} for: {silent}"


def test_the_page_is_generated_from_the_table():
    assert PAGE.read_text(encoding="utf-8") == annotations_page(), \
        "regenerate: .venv/bin/modulec explain --annotations > docs/annotations.md"


def test_the_page_lists_every_annotation():
    page = annotations_page()
    assert all(f"| `@{name}` |" in page for name in ANNOTATIONS)


def test_explain_prints_the_page():
    run = subprocess.run([sys.executable, "-m", "modulec", "explain", "--annotations"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0 and run.stdout == annotations_page()
