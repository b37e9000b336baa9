"""Syntax highlighting: the TextMate grammar (generated, syntax-tested and snapshot-tested
with vscode-tmgrammar-test), the Pygments lexer and the highlighted diagnostic line."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pygments.token import Comment, Error, Keyword, Name, Number, Operator, String, Token

from modulec.highlight import keywords as K
from modulec.highlight.lexer import ModuleLexer
from modulec.highlight.rich_line import highlight_line

REPO = Path(__file__).resolve().parent.parent
GENERATOR = REPO / "grammar" / "generate_tmlanguage.py"
RUNNER = REPO / "tests" / "grammar" / "run_grammar_tests.py"
TOOL = REPO / "editors" / "vscode" / "node_modules" / "vscode-tmgrammar-test" / "dist"

DSL_FILES = sorted(p for folder in ("std", "examples", "tests/ui/clean")
                   for p in (REPO / folder).rglob("*.module"))


def _ids(paths):
    return [str(p.relative_to(REPO)) for p in paths]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# =========================================================================== word lists
def test_primitive_names_are_the_op_table():
    from modulec.ops.registry import op_table

    assert K.primitive_names() == tuple(sorted(op_table()))


def test_section_keywords_cover_the_section_table():
    from modulec.syntax import sections

    known = set(K.SECTIONS) | {K.IMPL}
    tables = [*(s for s in sections.DECLARATION_SECTIONS.values() if s), sections.GRAPH_SECTIONS]
    missing = set().union(*tables) - known
    assert not missing, f"add {sorted(missing)} to SECTIONS in modulec/highlight/keywords.py"


def test_highlighting_imports_no_parser():
    code = ("import sys, modulec.highlight.lexer, modulec.highlight.rich_line\n"
            "bad = [m for m in sys.modules if m == 'lark' or m.startswith('modulec.syntax')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# =========================================================================== TextMate grammar
def test_generated_grammar_is_up_to_date():
    generator = _load(GENERATOR, "generate_tmlanguage")
    text = generator.render()
    for path in generator.OUTPUTS:
        assert path.is_file() and path.read_text(encoding="utf-8") == text, (
            f"{path.relative_to(REPO)} is out of date: run python grammar/generate_tmlanguage.py")
    grammar = json.loads(text)
    assert grammar["scopeName"] == "source.module"
    calls = grammar["repository"]["calls"]["patterns"][0]["match"]
    assert all(name in calls for name in K.primitive_names())


def test_vscode_extension_manifest():
    folder = REPO / "editors" / "vscode"
    manifest = json.loads((folder / "package.json").read_text())
    (language,) = manifest["contributes"]["languages"]
    (grammar,) = manifest["contributes"]["grammars"]
    assert language["extensions"] == [".module"]
    assert grammar["scopeName"] == "source.module" and grammar["language"] == language["id"]
    assert (folder / grammar["path"]).is_file()
    assert "vscode-tmgrammar-test" in manifest["devDependencies"]
    config = json.loads((folder / language["configuration"]).read_text())
    assert config["comments"]["lineComment"] == "#"
    assert config["folding"]["offSide"] is True
    assert {p["open"] for p in config["autoClosingPairs"]} >= {"(", "[", "{", '"', '"""'}


def _run_grammar_tests(which: str) -> None:
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the TextMate grammar tests need node")
    if not (TOOL / "unit.js").is_file():
        pytest.fail("vscode-tmgrammar-test is not installed: run make setup "
                    "(npm install --prefix editors/vscode)")
    done = subprocess.run([sys.executable, str(RUNNER), which], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_textmate_syntax_tests():
    """tests/grammar/*.test.module: scope assertions over every construct of the syntax."""
    _run_grammar_tests("unit")


def test_textmate_snapshots():
    """Every file of std/ and examples/ against tests/grammar/snap/ (update: see the runner)."""
    _run_grammar_tests("snap")


# =========================================================================== Pygments lexer
def _tokens(text: str):
    return [(t, v) for _, t, v in ModuleLexer().get_tokens_unprocessed(text)]


@pytest.mark.parametrize("path", DSL_FILES, ids=_ids(DSL_FILES))
def test_lexer_has_no_error_tokens(path):
    text = path.read_text(encoding="utf-8")
    tokens = _tokens(text)
    assert "".join(v for _, v in tokens) == text
    errors = [v for t, v in tokens if t in Error]
    assert not errors, errors[:10]


def test_lexer_error_token_for_foreign_characters():
    assert (Error, "$") in _tokens("module M():\n  params:\n    w: [d, d] $\n")


SNIPPET = '''"""File doc."""
import std.modules.{Linear, SwiGLU_MLP}
from std.modules.norm import RMSNormParams as Norm
abstract module Base(d: int, eps: float = 1e-5) extends Root:
  params:
    w: [d, d, bf16] @shard(column)
    blocks: [n] x Block(d)
  impl:
    forward: kernels.copy if not contiguous, else no-op   # text
  forward:
    in: x: [B, d]
    graph:
      x -> matmul(w, transpose=NT) -> y
      saved.x -> embedding_lookup(e) -> z
      if use_bias and not flag:
        (y, b) -> add() -> out
  hf_mapping:
    blocks[{i}].w: "model.layers.{i}.w"
  let:
    k = 32_000 // 2
'''


def test_lexer_token_classes():
    tokens = [(t, v) for t, v in _tokens(SNIPPET) if v.strip()]
    expect = [
        (String.Doc, '"""File doc."""'),
        (Keyword.Namespace, "import"), (Name.Namespace, "std"), (Name.Class, "Linear"),
        (Keyword.Namespace, "from"), (Keyword.Namespace, "as"), (Name.Class, "Norm"),
        (Keyword.Declaration, "abstract"), (Keyword.Declaration, "module"),
        (Name.Class, "Base"), (Name.Variable, "d"), (Keyword.Type, "int"),
        (Number.Float, "1e-5"), (Keyword.Declaration, "extends"), (Name.Class, "Root"),
        (Keyword.Reserved, "params"), (Name.Attribute, "w"), (Keyword.Type, "bf16"),
        (Name.Decorator, "@shard"), (Operator.Word, "x"), (Name.Class, "Block"),
        (Keyword.Reserved, "impl"), (Name.Attribute, "forward"),
        (String.Other, "kernels.copy if not contiguous, else no-op"), (Comment.Single, "# text"),
        (Keyword.Reserved, "in"), (Name.Variable, "x"),
        (Operator, "->"), (Name.Builtin, "matmul"), (Name.Variable, "transpose"),
        (Name.Builtin.Pseudo, "saved"), (Name.Function, "embedding_lookup"),
        (Keyword, "if"), (Operator.Word, "and"), (Operator.Word, "not"), (Name.Builtin, "add"),
        (String.Interpol, "{i}"), (String.Double, "model.layers."),
        (Name.Variable, "k"), (Number.Integer, "32_000"),
    ]
    missing = [pair for pair in expect if pair not in tokens]
    assert not missing, missing
    assert (Name.Builtin, "embedding") not in tokens  # a prefix of a name is not a primitive
    assert not any(t in Error for t, _ in tokens)


def test_analyse_text():
    dsl = (REPO / "std" / "primitives" / "matmul.module").read_text()
    assert ModuleLexer.analyse_text(dsl) == 1.0
    assert ModuleLexer.analyse_text((REPO / "examples" / "llama.module").read_text()) == 1.0
    gradle = '{\n  "formatVersion": "1.1",\n  "component": {"group": "org.example"}\n}\n'
    assert ModuleLexer.analyse_text(gradle) == 0.0
    assert ModuleLexer.analyse_text("[1, 2, 3]") == 0.0
    assert ModuleLexer.analyse_text("def f(x) -> int:\n    return x\n") < 0.5


class _EntryPoint:
    name = "module"

    def load(self):
        return ModuleLexer


@pytest.fixture
def registered(monkeypatch):
    """ModuleLexer registered as a Pygments plugin, as the pyproject entry point does."""
    import pygments.plugin

    monkeypatch.setattr(pygments.plugin, "iter_entry_points",
                        lambda group: [_EntryPoint()] if group == "pygments.lexers" else [])


def test_chosen_over_json_for_module_files(registered):
    from pygments.lexers import get_lexer_by_name, get_lexer_for_filename, guess_lexer

    for path in DSL_FILES:
        lexer = get_lexer_for_filename(path.name, path.read_text(encoding="utf-8"))
        assert isinstance(lexer, ModuleLexer), path
    assert isinstance(get_lexer_for_filename("x.module"), ModuleLexer)  # priority, no text
    assert get_lexer_for_filename("x.json").name == "JSON"
    assert isinstance(get_lexer_by_name("moduledsl"), ModuleLexer)
    # guess_lexer: for text without "import " (Pygments' Python lexer claims any text with
    # "import " in its first 1000 characters with certainty, before plugins are asked).
    assert isinstance(guess_lexer((REPO / "std/primitives/matmul.module").read_text()), ModuleLexer)
    assert isinstance(guess_lexer((REPO / "tests/ui/clean/swiglu_mlp.module").read_text()),
                      ModuleLexer)


def test_load_lexer_from_file():
    from pygments.lexers import load_lexer_from_file

    lexer = load_lexer_from_file(str(REPO / "modulec" / "highlight" / "lexer.py"), "ModuleLexer")
    assert lexer.name == "Module DSL" and lexer.aliases == ["module", "moduledsl"]
    assert not any(t in Error for t, _ in lexer.get_tokens(SNIPPET))


def test_entry_point_registration():
    from importlib.metadata import entry_points

    if not [e for e in entry_points(group="pygments.lexers") if e.value.startswith("modulec.")]:
        pytest.skip("the pygments.lexers entry point is not installed (pyproject.toml, make setup)")
    from pygments.lexers import get_lexer_by_name, get_lexer_for_filename

    assert type(get_lexer_by_name("module")).__name__ == "ModuleLexer"
    dsl = (REPO / "examples" / "llama.module").read_text()
    assert type(get_lexer_for_filename("llama.module", dsl)).__name__ == "ModuleLexer"


# =========================================================================== diagnostics line
SAMPLE = DSL_FILES[:12] + DSL_FILES[-6:]


@pytest.mark.parametrize("path", SAMPLE, ids=_ids(SAMPLE))
def test_highlight_line_keeps_the_text(path):
    for line in path.read_text(encoding="utf-8").splitlines():
        assert highlight_line(line).plain == line


def test_highlight_line_styles():
    text = highlight_line("      x -> matmul(w, transpose=NT) -> y  @hook(A)  # note")
    styles = {text.plain[s.start:s.end].strip(): str(s.style) for s in text.spans}
    assert styles["matmul"] == "cyan"
    assert styles["@hook"] == "magenta"
    assert styles["# note"] == "dim"
    assert "x" not in styles  # plain names stay plain
    assert highlight_line("module M(d: int):").spans[0].style == "bold magenta"
    assert highlight_line("").plain == ""
    broken = "    w: [d, d] $\ufffd"
    assert highlight_line(broken).plain == broken  # unknown characters: unstyled, kept
    for span in highlight_line(broken).spans:
        assert "red" not in str(span.style) and "yellow" not in str(span.style)


def test_highlight_line_token_theme_covers_every_class():
    from modulec.highlight.rich_line import style_for

    assert style_for(Token.Keyword.Reserved) == "magenta"  # inherited from Keyword
    assert style_for(Token.Literal.String.Doc) == "green"
    assert style_for(Token.Name) == ""
