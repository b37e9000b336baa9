"""The word lists both highlighters share: the TextMate grammar (generated from these by
`grammar/generate_tmlanguage.py`) and the Pygments lexer (`modulec.highlight.lexer`).

Cheap to import on purpose (pathlib only, no lark, no parser): the primitive names are the
file names of the op table, `std/primitives/<name>.module`, so a new primitive is
highlighted as soon as its file exists and is never typed twice.
"""

from __future__ import annotations

from modulec.paths import data_dir

# `abstract module`, `module`, ...: what starts a top-level declaration (grammar: decl_kind).
DECLARATION_KINDS = ("module", "block", "model", "primitive", "recipe")
DECLARATION_MODIFIERS = ("abstract",)
INHERITANCE = ("extends",)

# Section names: a word at the start of a line followed by `:`. A superset of the table in
# modulec/syntax/sections.py (tests/test_highlighting.py checks it stays one), plus the
# nested sections the checker reads (`constraint:` in `let:`, `param_mapping:` in
# `hf_config:`). `impl` is reserved (its values are free text) and has its own rule.
SECTIONS = (
    "params", "forward", "backward", "let", "constraint", "constants", "graph", "save",
    "recompute", "in", "out", "inputs", "outputs", "pattern", "hf_config", "hf_mapping",
    "hf_export", "param_mapping", "memory", "fusion", "precision", "invariants", "verify_backward",
    "constraints", "collective",
)
IMPL = "impl"

CONDITIONALS = ("if", "else")
LOGICAL_OPERATORS = ("and", "or", "not")
IMPORT_KEYWORDS = ("import", "from", "as")
BOOLEANS = ("true", "false")
NONE = "None"
ARRAY = "Array"

# Spec §3.3 (int4 is used by quantised weights).
DTYPES = ("bf16", "fp32", "fp16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "int8", "int32", "int4")
# Spec §3.1 and the parameter kinds of primitives (`transpose: enum(NN, NT) = NN`).
SCALAR_TYPES = ("int", "float", "bool", "string", "enum")


def primitive_names() -> tuple[str, ...]:
    """Names of the primitives: the op table's files, `std/primitives/*.module`, sorted."""
    folder = data_dir("std") / "primitives"
    return tuple(sorted(path.stem for path in folder.glob("*.module")))


def words_regex(words) -> str:
    """`(?:a|b|c)` with longer words first, so that no word shadows a longer one."""
    return "(?:" + "|".join(sorted(words, key=lambda w: (-len(w), w))) + ")"
