"""Import resolution (modulec.resolve): module paths, bindings, diagnostics, module.lock."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from modulec.cli.main import modulec
from modulec.paths import data_dir
from modulec.resolve import Resolver
from modulec.source import Span

SPAN = Span("<lookup>", 0, 1, 1, 1, 1, 2)
OTHER_SPAN = Span("<lookup>", 5, 6, 2, 1, 2, 2)


def decl(name: str, kind: str = "module") -> str:
    if kind == "primitive":
        return f"primitive {name}:\n  forward:\n    in: a: [*]\n    out: y: [*]\n\n"
    return f"{kind} {name}(d: int):\n  forward:\n    in: x: [B, d]\n    out: y: [B, d]\n\n"


def tree(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


@pytest.fixture(autouse=True)
def no_modulepath(monkeypatch):
    monkeypatch.delenv("MODULEPATH", raising=False)


@pytest.fixture
def std(tmp_path) -> Path:
    return tree(tmp_path / "std", {
        "primitives/relu.module": decl("relu", "primitive"),
        "primitives/matmul.module": decl("matmul", "primitive"),
        "modules/attention.v1.module": decl("GQA") + decl("MHA"),
        "modules/attention.v2.module": decl("GQA"),
        "modules/linear.module": decl("Linear"),
        "blocks/dense.module": decl("Dense", "block") + decl("Sparse", "block"),
    })


@pytest.fixture
def proj(tmp_path) -> Path:
    return tree(tmp_path / "proj", {
        "models/llama.module": decl("LlamaAttention") + decl("LlamaMLP"),
        "models/qwen.module": decl("QwenMLP") + decl("LlamaMLP"),
    })


def load(proj: Path, std: Path, text: str, search_path=(), name="main.module"):
    entry = tree(proj, {name: text}) / name
    resolver = Resolver(list(search_path), std_root=std)
    return resolver.load(entry), resolver


def codes(file) -> list[str]:
    return [d.code for d in file.diagnostics]


def at(diagnostic) -> tuple[int, int]:
    span = diagnostic.primary_span
    return span.line, span.column


def one(file, code: str):
    found = [d for d in file.diagnostics if d.code == code]
    assert len(found) == 1, file.diagnostics
    return found[0]


# ============================================================ binding forms
def test_import_declaration_binds_its_name_and_qualified_path(proj, std):
    file, _ = load(proj, std, "import models.llama.LlamaAttention\n")
    binding = file.scope.lookup("LlamaAttention", SPAN)
    assert (binding.name, binding.module_path, binding.kind, binding.origin, binding.version) \
        == ("LlamaAttention", "models.llama", "module", "import", None)
    assert binding.file == (proj / "models/llama.module").resolve()
    assert binding.decl.name == "LlamaAttention"
    assert file.scope.lookup_qualified(("models", "llama", "LlamaAttention"), SPAN) == binding
    assert file.scope.lookup("LlamaMLP", SPAN) is None
    assert file.diagnostics == []


def test_import_declaration_as_alias_binds_only_the_alias(proj, std):
    file, _ = load(proj, std, "import models.llama.LlamaAttention as Attn\n")
    assert file.scope.lookup("Attn", SPAN).decl.name == "LlamaAttention"
    assert file.scope.lookup("Attn", SPAN).name == "Attn"
    assert file.scope.lookup("LlamaAttention", SPAN) is None
    assert file.scope.lookup_qualified(("models", "llama", "LlamaAttention"), SPAN) is None


@pytest.mark.parametrize("text", [
    "import models.llama.{LlamaAttention, LlamaMLP as MLP}\n",
    "from models.llama import LlamaAttention, LlamaMLP as MLP\n",
    "from models.llama import (LlamaAttention,\n    LlamaMLP as MLP)\n",
])
def test_item_lists_bind_items_and_aliases(proj, std, text):
    file, _ = load(proj, std, text)
    assert file.scope.lookup("LlamaAttention", SPAN).decl.name == "LlamaAttention"
    assert file.scope.lookup("MLP", SPAN).decl.name == "LlamaMLP"
    assert file.scope.lookup("LlamaMLP", SPAN) is None
    assert file.diagnostics == []


def test_whole_file_import_binds_unqualified_and_qualified(proj, std):
    file, _ = load(proj, std, "import models.llama\n")
    mlp = file.scope.lookup("LlamaMLP", SPAN)
    assert mlp.module_path == "models.llama"
    assert file.scope.lookup_qualified(("models", "llama", "LlamaMLP"), SPAN) == mlp
    assert file.scope.lookup_qualified(("llama", "LlamaMLP"), SPAN) is None


def test_whole_folder_import_binds_every_file(std, proj):
    file, _ = load(proj, std, "import std.blocks\nimport std.primitives\n")
    assert file.scope.lookup("Dense", SPAN).kind == "block"
    assert file.scope.lookup_qualified(("std", "blocks", "Sparse"), SPAN).module_path \
        == "std.blocks.dense"
    assert file.scope.lookup("relu", SPAN).origin == "import"


def test_module_alias_binds_a_prefix_only(proj, std):
    file, _ = load(proj, std, "import std.modules.attention as A\n")
    gqa = file.scope.lookup_qualified(("A", "GQA"), SPAN)
    assert (gqa.module_path, gqa.version) == ("std.modules.attention", "v2")
    assert file.scope.lookup("GQA", SPAN) is None
    assert file.scope.lookup("A", SPAN) is None
    assert file.scope.lookup_qualified(("std", "modules", "attention", "GQA"), SPAN) is None


def test_from_import_of_a_file_binds_a_prefix(proj, std):
    file, _ = load(proj, std, "from std.blocks import dense\nfrom models import qwen as Q\n")
    assert file.scope.lookup_qualified(("dense", "Dense"), SPAN).kind == "block"
    assert file.scope.lookup_qualified(("Q", "QwenMLP"), SPAN).module_path == "models.qwen"
    assert file.scope.lookup("Dense", SPAN) is None


def test_declaration_found_in_a_folder(proj, std):
    file, _ = load(proj, std, "import std.modules.Linear\n")
    assert file.scope.lookup("Linear", SPAN).module_path == "std.modules.linear"
    assert file.diagnostics == []


def test_local_declarations_and_prelude(proj, std):
    file, resolver = load(proj, std, decl("Mine") + decl("Other", "model"))
    assert file.scope.lookup("Mine", SPAN).origin == "local"
    assert file.scope.lookup("Other", SPAN).kind == "model"
    relu = file.scope.lookup("relu", SPAN)
    assert (relu.origin, relu.kind, relu.module_path) == ("prelude", "primitive",
                                                          "std.primitives.relu")
    assert set(resolver.primitives()) == {"relu", "matmul"}
    assert "relu" in file.scope.visible_names()


def test_imports_win_over_the_prelude_silently(tmp_path, std):
    lib = tree(tmp_path / "lib", {"ops.module": decl("relu")})
    file, _ = load(tmp_path / "p", std, "import ops.relu\n", search_path=[lib])
    assert file.scope.lookup("relu", SPAN).origin == "import"
    assert file.diagnostics == []


# ============================================================ search order
def test_std_paths_are_looked_up_in_the_std_root_only(proj, std):
    tree(proj, {"std/modules/linear.module": decl("Linear") + decl("Fake")})
    file, _ = load(proj, std, "import std.modules.linear\n")
    assert file.scope.lookup("Linear", SPAN).file == (std / "modules/linear.module").resolve()
    assert file.scope.lookup("Fake", SPAN) is None


def test_local_folder_then_path_then_modulepath(tmp_path, std, monkeypatch):
    first, second, env1, env2 = (tmp_path / n for n in ("first", "second", "env1", "env2"))
    for folder in (first, second, env1, env2):
        tree(folder, {"shared.module": decl("Shared"), f"{folder.name}.module": decl("Own")})
    tree(tmp_path / "p", {"shared.module": decl("Shared")})
    monkeypatch.setenv("MODULEPATH", os.pathsep.join([str(env1), "", str(env2)]))
    text = "import shared.Shared\nimport second.Own as S\nimport env2.Own as E\n"
    file, _ = load(tmp_path / "p", std, text, search_path=[first, second])
    assert file.scope.lookup("Shared", SPAN).file == (tmp_path / "p/shared.module").resolve()
    assert file.scope.lookup("S", SPAN).file.parent == second.resolve()
    assert file.scope.lookup("E", SPAN).file.parent == env2.resolve()
    (tmp_path / "p/shared.module").unlink()
    file, _ = load(tmp_path / "p", std, text, search_path=[first, second], name="m2.module")
    assert file.scope.lookup("Shared", SPAN).file.parent == first.resolve()


def test_a_root_matches_only_when_the_whole_path_resolves(tmp_path, std):
    lib = tree(tmp_path / "lib", {"models/llama.module": decl("Only")})
    tree(tmp_path / "p", {"models/llama.module": decl("Other")})
    file, _ = load(tmp_path / "p", std, "import models.llama.Only\n", search_path=[lib])
    assert file.scope.lookup("Only", SPAN).file.parent == (lib / "models").resolve()


# ============================================================ versions
def test_explicit_and_latest_versions(proj, std):
    tree(std, {f"modules/norm.v{n}.module": decl(f"Norm{n}") for n in (2, 9, 10)})
    file, _ = load(proj, std, "import std.modules.attention.v1\nimport std.modules.norm\n"
                              "from std.modules.attention.v2 import GQA as G2\n")
    assert file.scope.lookup("MHA", SPAN).version == "v1"
    assert file.scope.lookup("Norm10", SPAN).version == "v10"
    assert file.scope.lookup("Norm9", SPAN) is None
    assert file.scope.lookup("G2", SPAN).version == "v2"
    assert file.scope.lookup("GQA", SPAN).version == "v1"
    assert file.diagnostics == []


def test_missing_version_lists_the_available_ones(proj, std):
    file, _ = load(proj, std, "import std.modules.attention.v3\nimport std.modules.linear.v1\n")
    first, second = file.diagnostics
    assert (first.code, at(first)) == ("E002", (1, 30))
    assert first.message == "cannot find module path `std.modules.attention.v3`"
    assert "available versions of `attention`: v1, v2" in first.notes
    assert (second.code, at(second)) == ("E002", (2, 27))
    assert "available versions of `linear`: none (only the unversioned file)" in second.notes


# ============================================================ diagnostics
def test_unknown_path_did_you_mean_and_roots(proj, std):
    file, _ = load(proj, std, "import models.lama.X\nimport models.llama.LlamaMlp\n")
    first, second = file.diagnostics
    assert (first.code, at(first), first.help) == ("E002", (1, 15),
                                                   ("did you mean `llama`?",))
    assert first.notes == (f"searched: {proj.resolve()} (the importing file's folder)",)
    assert (second.code, at(second)) == ("E002", (2, 21))
    assert second.help == ("did you mean `LlamaMLP`?",)


def test_unknown_path_suggests_the_std_spelling(proj, std):
    file, _ = load(proj, std, "import modules.linear\n")
    assert one(file, "E002").help[-1] == "the standard library has it: `std.modules.linear`"


def test_spec_import_primitives_points_to_the_prelude(proj, std):
    file, _ = load(proj, std, "import primitives\nimport std\n")
    assert codes(file) == ["E002"]
    assert file.diagnostics[0].help == ("the standard library has it: `std.primitives`",)


def test_failed_statement_path_is_reported_once(proj, std):
    file, _ = load(proj, std, "from modelz.llama import A, B, C\n")
    assert codes(file) == ["E002"]
    assert file.diagnostics[0].message == "cannot find module path `modelz.llama`"
    assert file.scope.unresolved_import(("A",)) and not file.scope.unresolved_import(("Z",))


def test_explicit_imports_of_one_name_conflict(proj, std):
    text = ("import models.llama.LlamaMLP\nimport models.qwen.{LlamaMLP}\n"
            "import models.llama.LlamaMLP\n")
    file, _ = load(proj, std, text)
    conflict = one(file, "E023")
    assert at(conflict) == (2, 21)
    assert [(label.span.line, label.message) for label in conflict.labels if not label.primary] \
        == [(1, "first imported here")]
    assert "rename one with `as`" in conflict.help[0]


def test_whole_module_imports_conflict_only_when_looked_up(proj, std):
    file, _ = load(proj, std, "import models.llama\nimport models.qwen\nimport models\n")
    assert file.diagnostics == []
    assert file.scope.lookup("QwenMLP", SPAN).name == "QwenMLP"
    assert file.scope.lookup("LlamaMLP", SPAN) is None
    assert file.scope.lookup("LlamaMLP", SPAN) is None  # reported once per place
    assert file.scope.lookup_qualified(("models", "LlamaMLP"), OTHER_SPAN) is None
    first, second = file.diagnostics
    assert (first.code, first.primary_span) == ("E023", SPAN)
    assert [label.span.line for label in first.labels if not label.primary][:2] == [1, 2]
    assert (second.code, second.primary_span) == ("E023", OTHER_SPAN)


def test_same_declaration_twice_is_no_conflict(proj, std):
    file, _ = load(proj, std, "import models.llama\nimport models.llama.LlamaMLP\n"
                              "import models\n")
    assert file.scope.lookup("LlamaMLP", SPAN).module_path == "models.llama"
    assert file.scope.lookup("LlamaAttention", SPAN) is not None
    assert file.diagnostics == []


def test_declaration_in_two_files_of_a_folder(proj, std):
    file, _ = load(proj, std, "import models.LlamaMLP\n")
    error = one(file, "E023")
    assert at(error) == (1, 15)
    assert "`llama.module` and `qwen.module`" in error.message


@pytest.mark.parametrize("text, line, column", [
    ("import models.llama.LlamaMLP\nimport models.qwen.QwenMLP as LlamaMLP\n", 2, 31),
    ("import models.qwen.QwenMLP as LlamaMLP\nimport models.llama.LlamaMLP\n", 1, 31),
    ("import models.llama\nimport models.qwen.QwenMLP as LlamaAttention\n", 2, 31),
    ("from models import qwen as Mine\n" + decl("Mine"), 1, 28),
    ("import models.qwen.{QwenMLP as Mine}\n" + decl("Mine"), 1, 32),
])
def test_alias_shadowing_an_existing_name(proj, std, text, line, column):
    file, _ = load(proj, std, text)
    error = one(file, "E024")
    assert at(error) == (line, column)
    assert error.help == ("choose an alias that is not used in this file",)


def test_local_declaration_shadows_an_import(proj, std):
    file, _ = load(proj, std, "import models.llama.LlamaMLP\nimport models.qwen\n"
                              + decl("LlamaMLP") + decl("QwenMLP"))
    first, second = file.diagnostics
    assert (first.code, at(first), second.code, at(second)) == ("W002", (3, 8), "W002", (8, 8))
    assert file.scope.lookup("QwenMLP", SPAN).origin == "local"


def test_user_declaration_shadows_a_primitive(proj, std):
    file, _ = load(proj, std, decl("relu"))
    warning = one(file, "W001")
    assert (at(warning), warning.notes) == ((1, 8), ("the primitive is declared in "
                                                    "`std.primitives.relu`",))
    assert file.scope.lookup("relu", SPAN).origin == "local"
    resolver = Resolver(std_root=std)
    assert resolver.load(std / "primitives/relu.module").diagnostics == []


def test_import_cycles(proj, std):
    tree(proj, {"a.module": "import b.B\n" + decl("A"), "b.module": "import c\n" + decl("B"),
                "c.module": "import a.A\n" + decl("C"),
                "self.module": "import self.S\n" + decl("S")})
    resolver = Resolver(std_root=std)
    a = resolver.load(proj / "a.module")
    c = resolver.load(proj / "c.module")
    cycle = one(c, "E007")
    assert (cycle.message, at(cycle)) == ("circular import", (1, 8))
    assert cycle.notes == ("import chain: c.module -> a.module -> b.module -> c.module",)
    # Every file on the loop reports it at its own import, told from itself, whichever
    # file loading started from (checked together or alone, each file says the same).
    assert [d.notes for d in a.diagnostics] == [
        ("import chain: a.module -> b.module -> c.module -> a.module",)]
    assert at(a.diagnostics[0]) == (1, 8)
    b = one(resolver.load(proj / "b.module"), "E007")
    assert b.notes == ("import chain: b.module -> c.module -> a.module -> b.module",)
    assert c.scope.lookup("A", SPAN) is not None  # bound anyway: no follow-on errors
    itself = one(resolver.load(proj / "self.module"), "E007")
    assert itself.notes == ("import chain: self.module -> self.module",)


def test_syntax_error_in_imported_file_is_reported_once(proj, std):
    tree(proj, {"bad.module": "module Bad(:\n", "lib/worse.module": "module W(:\n"})
    file, resolver = load(proj, std, "import bad.Bad\nfrom bad import X\nimport bad as B\n"
                                     "import lib.W\nimport lib\n")
    assert file.diagnostics == []
    assert file.scope.unresolved_import(("Bad",)) and file.scope.unresolved_import(("B", "Y"))
    broken = {f.module_path: codes(f) for f in resolver.files() if f.diagnostics}
    assert broken == {"bad": ["E001"], "lib.worse": ["E001"]}


def test_cycle_through_a_file_with_a_syntax_error(proj, std):
    tree(proj, {"a.module": "import b.B\n" + decl("A") + "module Bad(:\n",
                "b.module": "import a.A\n" + decl("B")})
    resolver = Resolver(std_root=std)
    a = resolver.load(proj / "a.module")
    assert codes(a) == ["E001"] and a.scope.lookup("B", SPAN) is not None
    assert resolver.load(proj / "b.module").diagnostics == []


def test_alias_on_a_brace_list_is_an_error(proj, std):
    file, _ = load(proj, std, "import models.llama.{LlamaMLP} as X\n")
    assert codes(file) == ["E001"]


# ============================================================ paths never escape
def test_symlinked_file_outside_the_root_is_refused(tmp_path, std):
    outside = tree(tmp_path / "outside", {"secret.module": decl("Secret")})
    proj = tree(tmp_path / "p", {"inside.module": decl("Inside")})
    (proj / "secret.module").symlink_to(outside / "secret.module")
    (proj / "linked").symlink_to(outside, target_is_directory=True)
    (proj / "inner").mkdir()
    (proj / "inner/alias.module").symlink_to(proj / "inside.module")
    file, _ = load(proj, std, "import secret.Secret\nimport linked.secret\nimport Secret\n"
                              "import inner.alias.Inside\n")
    errors = [d for d in file.diagnostics if d.code == "E002"]
    assert [at(d) for d in errors] == [(1, 8), (2, 8), (3, 8)]
    assert all("import paths never escape the search roots" in d.notes for d in errors)
    assert file.scope.lookup("Inside", SPAN) is not None


# ============================================================ module.lock
def test_lock_file_content_and_determinism(tmp_path, std, proj, monkeypatch):
    monkeypatch.setattr("modulec.resolve.resolver.data_dir", lambda name: std)
    lib = tree(tmp_path / "lib", {"extra.v2.module": decl("Extra")})
    tree(proj, {"models/llama.module": "import layers.Norm\n" + decl("LlamaAttention"),
                "models/layers.module": decl("Norm")})
    entry = tree(proj, {"main.module": "import models.llama.LlamaAttention\nimport extra\n"
                        "import std.modules.attention.GQA\nimport std.modules.linear\n"})
    result = CliRunner().invoke(modulec, ["lock", str(entry / "main.module"), "--path", str(lib)])
    assert result.exit_code == 0, result.output
    text = (proj / "module.lock").read_text()
    digest = lambda p: __import__("hashlib").sha256(p.read_bytes()).hexdigest()[:12]  # noqa: E731
    assert text == (
        "# module.lock (generated by modulec lock; do not edit)\nversion: 1\nresolved_modules:\n"
        f"  extra: local@v2 sha256:{digest(lib / 'extra.v2.module')}\n"
        f"  models.layers: local@{digest(proj / 'models/layers.module')}\n"
        f"  models.llama: local@{digest(proj / 'models/llama.module')}\n"
        f"  std.modules.attention: std@v2 sha256:{digest(std / 'modules/attention.v2.module')}\n"
        f"  std.modules.linear: std@latest sha256:{digest(std / 'modules/linear.module')}\n")
    assert "wrote" in result.output and "5 modules locked" in result.output
    again = CliRunner().invoke(modulec, ["lock", str(entry / "main.module"), "--path", str(lib)])
    assert again.exit_code == 0 and (proj / "module.lock").read_text() == text
    assert sorted(p.name for p in proj.iterdir()) == ["main.module", "models", "module.lock"]


def test_lock_reports_errors_and_writes_nothing(proj, std):
    tree(proj, {"main.module": "import models.nope\n"})
    result = CliRunner().invoke(modulec, ["lock", str(proj / "main.module")])
    assert result.exit_code == 1
    assert "error[E002]: cannot find module path `models.nope`" in result.output
    assert not (proj / "module.lock").exists()


def test_lock_without_imports(proj):
    tree(proj, {"main.module": decl("M")})
    assert CliRunner().invoke(modulec, ["lock", str(proj / "main.module")]).exit_code == 0
    assert (proj / "module.lock").read_text().endswith("resolved_modules: {}\n")


def test_check_and_build_read_the_lock_back(tmp_path):
    """A module edited since `modulec lock` is W007 in check and build, with the command
    that updates the lock; after it, neither reports anything about the lock."""
    proj = tmp_path / "proj"
    tree(proj, {"lib/proj.module": "module Proj(C: int):\n  params:\n    w: [C, C]\n"
                "  forward:\n    in: x: [B, C]\n    out: y: [B, C]\n    graph:\n"
                "      x -> matmul(w, transpose=NT) -> y\n",
                "main.module": "import lib.proj.Proj\n\nmodel M(C: int = 4):\n  params:\n"
                "    p: Proj(C)\n  forward:\n    in: x: [B, C]\n    out: y: [B, C]\n"
                "    graph:\n      x -> p -> y\n"})
    main = str(proj / "main.module")
    assert CliRunner().invoke(modulec, ["lock", main]).exit_code == 0
    with open(proj / "lib/proj.module", "a") as module:
        module.write("# edited after locking\n")
    for command in (["check", main], ["build", main, "--shape", "B=2", "-o",
                                       str(tmp_path / "ir.json")]):
        result = CliRunner().invoke(modulec, command)
        assert result.exit_code == 0, result.output
        assert "warning[W007]: `module.lock` is out of date: `lib.proj` is locked as" \
            in result.output, command
        assert f"run `modulec lock {main}`" in result.output
    assert CliRunner().invoke(modulec, ["lock", main]).exit_code == 0
    assert "W007" not in CliRunner().invoke(modulec, ["check", main]).output


# ============================================================ the real standard library
def test_real_std_loads_without_diagnostics_quickly():
    started = time.perf_counter()
    resolver = Resolver()
    files = [resolver.load(path) for path in sorted(data_dir("std").rglob("*.module"))]
    elapsed = time.perf_counter() - started
    assert files and all(f.diagnostics == [] for f in files)
    assert "matmul" in resolver.primitives()
    assert elapsed < 1.0
