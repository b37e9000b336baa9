"""Generate the TextMate grammar of the Module DSL (scope `source.module`).

    python grammar/generate_tmlanguage.py           # write the grammar files
    python grammar/generate_tmlanguage.py --check   # exit 1 if they are out of date

The word lists come from `modulec/highlight/keywords.py`, which the Pygments lexer shares;
the primitive names are the op table's file names (`std/primitives/*.module`), so adding
a primitive means re-running this script, and tests/test_highlighting.py fails until then.

Two identical files are written: `grammar/module.tmLanguage.json` (the grammar the syntax
tests run against) and `editors/vscode/syntaxes/module.tmLanguage.json` (the copy the
VS Code extension packages: an extension may only reference files inside its folder).

TextMate grammars see one line at a time; the rules are line rules except for regions
that really span lines: docstrings, brackets (newlines inside brackets continue a
statement), declaration headers with their parameter lists, imports with parentheses and
`impl:` blocks (whose values are free text, ended by the first line indented no deeper
than `impl` itself).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from modulec.highlight import keywords as K  # noqa: E402

OUTPUTS = (REPO / "grammar" / "module.tmLanguage.json",
           REPO / "editors" / "vscode" / "syntaxes" / "module.tmLanguage.json")

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
# The text of an `impl:` value: up to a comment, without surrounding blanks (IMPL_TEXT).
IMPL_TEXT = r"[^\s#](?:[^#\r\n]*[^\s#])?"
# Where an operand ends: the character before an index `[` or the array operator `x`.
OPERAND_END = r"[A-Za-z0-9_)\]]"
# `in: x: [B, d]`: the tensor's name after a section key (grammar: named_value).
NAMED_VALUE = rf"(?:[ \t]*({IDENT})[ \t]*(:)(?=[ \t]))?"


def words(items) -> str:
    return K.words_regex(items)


def build() -> dict:
    section = words(K.SECTIONS)
    primitives = words(K.primitive_names())
    repository = {
        # ------------------------------------------------------------ comments and strings
        "comment": {
            "name": "comment.line.number-sign.module",
            "match": r"(#).*$",
            "captures": {"1": {"name": "punctuation.definition.comment.module"}},
        },
        "docstring": {
            "name": "string.quoted.docstring.multi.module",
            "begin": '"""',
            "beginCaptures": {"0": {"name": "punctuation.definition.string.begin.module"}},
            "end": '"""',
            "endCaptures": {"0": {"name": "punctuation.definition.string.end.module"}},
        },
        "string": {
            "name": "string.quoted.double.module",
            "begin": '"',
            "beginCaptures": {"0": {"name": "punctuation.definition.string.begin.module"}},
            "end": r'(")|$',
            "endCaptures": {"1": {"name": "punctuation.definition.string.end.module"}},
            "patterns": [
                {"name": "constant.character.escape.module", "match": r"\\."},
                {"include": "#placeholder"},
            ],
        },
        "placeholder": {
            "comment": "`{i}`: the layer index in hf_mapping keys and checkpoint names",
            "name": "constant.other.placeholder.module",
            "match": rf"(\{{)({IDENT})(\}})",
            "captures": {
                "1": {"name": "punctuation.definition.placeholder.begin.module"},
                "3": {"name": "punctuation.definition.placeholder.end.module"},
            },
        },
        # ------------------------------------------------------------ imports
        "import": {
            "name": "meta.statement.import.module",
            "begin": r"^(import)\b",
            "beginCaptures": {"1": {"name": "keyword.control.import.module"}},
            "end": r"$",
            "patterns": [
                {"include": "#comment"},
                {"name": "keyword.control.import.module", "match": r"\bas\b"},
                {
                    "name": "meta.import.names.module",
                    "begin": r"\{",
                    "beginCaptures": {"0": {"name": "punctuation.definition.import.begin.module"}},
                    "end": r"\}",
                    "endCaptures": {"0": {"name": "punctuation.definition.import.end.module"}},
                    "patterns": [{"include": "#import-names"}],
                },
                {"name": "punctuation.accessor.module", "match": r"\."},
                {"name": "entity.name.namespace.module", "match": IDENT},
            ],
        },
        "from-import": {
            "name": "meta.statement.import.module",
            "begin": r"^(from)\b",
            "beginCaptures": {"1": {"name": "keyword.control.import.module"}},
            "end": r"$",
            "patterns": [
                {"include": "#comment"},
                {
                    "begin": r"\b(import)\b",
                    "beginCaptures": {"1": {"name": "keyword.control.import.module"}},
                    "end": r"$",
                    "patterns": [
                        {
                            "begin": r"\(",
                            "beginCaptures": {
                                "0": {"name": "punctuation.parenthesis.begin.module"}},
                            "end": r"\)",
                            "endCaptures": {"0": {"name": "punctuation.parenthesis.end.module"}},
                            "patterns": [{"include": "#import-names"}],
                        },
                        {"include": "#import-names"},
                    ],
                },
                {"name": "punctuation.accessor.module", "match": r"\."},
                {"name": "entity.name.namespace.module", "match": IDENT},
            ],
        },
        "import-names": {
            "patterns": [
                {"include": "#comment"},
                {"name": "keyword.control.import.module", "match": r"\bas\b"},
                {"name": "punctuation.separator.comma.module", "match": ","},
                {"name": "entity.name.type.module", "match": IDENT},
            ],
        },
        # ------------------------------------------------------------ declarations
        "declaration": {
            "name": "meta.declaration.module",
            "begin": (rf"^(?:({words(K.DECLARATION_MODIFIERS)})\s+)?"
                      rf"({words(K.DECLARATION_KINDS)})(?=\s|$)(?:\s+({IDENT}))?"),
            "beginCaptures": {
                "1": {"name": "storage.modifier.abstract.module"},
                "2": {"name": "storage.type.declaration.module"},
                "3": {"name": "entity.name.type.module"},
            },
            "end": r"(:)|$",
            "endCaptures": {"1": {"name": "punctuation.section.declaration.begin.module"}},
            "patterns": [
                {"include": "#comment"},
                {
                    "comment": "extends Base(args): the arguments are not parameters",
                    "begin": rf"\b({words(K.INHERITANCE)})\s+({IDENT})\s*(\()",
                    "beginCaptures": {
                        "1": {"name": "storage.modifier.extends.module"},
                        "2": {"name": "entity.other.inherited-class.module"},
                        "3": {"name": "punctuation.parenthesis.begin.module"},
                    },
                    "end": r"\)",
                    "endCaptures": {"0": {"name": "punctuation.parenthesis.end.module"}},
                    "patterns": [{"include": "#arguments"}],
                },
                {"include": "#declaration-parameters"},
                {
                    "match": rf"\b({words(K.INHERITANCE)})\b(?:\s+({IDENT}))?",
                    "captures": {
                        "1": {"name": "storage.modifier.extends.module"},
                        "2": {"name": "entity.other.inherited-class.module"},
                    },
                },
                {"include": "#expression"},
            ],
        },
        "declaration-parameters": {
            "name": "meta.declaration.parameters.module",
            "begin": r"\(",
            "beginCaptures": {"0": {"name": "punctuation.definition.parameters.begin.module"}},
            "end": r"\)",
            "endCaptures": {"0": {"name": "punctuation.definition.parameters.end.module"}},
            "patterns": [
                {"include": "#comment"},
                {
                    "comment": "a parameter name: after the `(`, after a comma, first on a line",
                    "match": rf"(?:(?<=\()|(?<=,)|^)\s*({IDENT})(?=\s*(?:[:=,)]|$))",
                    "captures": {"1": {"name": "variable.parameter.module"}},
                },
                {"include": "#expression"},
            ],
        },
        # ------------------------------------------------------------ section bodies
        "impl-block": {
            "comment": "impl: values are free text (decisions.md), up to a comment",
            "name": "meta.impl.module",
            "begin": rf"^([ \t]*)(impl)[ \t]*(:)(?:[ \t]*({IMPL_TEXT}))?",
            "beginCaptures": {
                "2": {"name": "keyword.other.section.module"},
                "3": {"name": "punctuation.separator.key-value.module"},
                "4": {"name": "string.unquoted.impl.module"},
            },
            "end": r"^(?=[ \t]*[^\s#])(?!\1[ \t]+\S)",
            "patterns": [
                {"include": "#comment"},
                {
                    "match": rf"^[ \t]*({IDENT})[ \t]*(:)(?:[ \t]*({IMPL_TEXT}))?",
                    "captures": {
                        "1": {"name": "variable.other.key.module"},
                        "2": {"name": "punctuation.separator.key-value.module"},
                        "3": {"name": "string.unquoted.impl.module"},
                    },
                },
            ],
        },
        "section": {
            "match": rf"^[ \t]*(?:(-)[ \t]+)?({section})[ \t]*(:){NAMED_VALUE}",
            "captures": {
                "1": {"name": "punctuation.definition.list.begin.module"},
                "2": {"name": "keyword.other.section.module"},
                "3": {"name": "punctuation.separator.key-value.module"},
                "4": {"name": "variable.parameter.module"},
                "5": {"name": "punctuation.separator.colon.module"},
            },
        },
        "key": {
            "comment": "`name:` at the start of a line: a parameter, tensor or setting",
            "match": (rf"^[ \t]*(?:(-)[ \t]+)?(?:(\+)[ \t]*)?"
                      rf"(?!(?:{words(K.CONDITIONALS)})\b)({IDENT})[ \t]*(:){NAMED_VALUE}"),
            "captures": {
                "1": {"name": "punctuation.definition.list.begin.module"},
                "2": {"name": "keyword.operator.arithmetic.module"},
                "3": {"name": "variable.other.key.module"},
                "4": {"name": "punctuation.separator.key-value.module"},
                "5": {"name": "variable.parameter.module"},
                "6": {"name": "punctuation.separator.colon.module"},
            },
        },
        "binding": {
            "comment": "`name = expr` at the start of a line (let:, constants:, backward bodies)",
            "match": rf"^[ \t]*(?:(-)[ \t]+)?({IDENT})[ \t]*(?==(?!=))",
            "captures": {
                "1": {"name": "punctuation.definition.list.begin.module"},
                "2": {"name": "variable.other.assignment.module"},
            },
        },
        "list-dash": {
            "match": r"^[ \t]*(-)(?=[ \t]|$)",
            "captures": {"1": {"name": "punctuation.definition.list.begin.module"}},
        },
        # ------------------------------------------------------------ expressions
        "expression": {
            "patterns": [
                {"include": "#comment"},
                {"include": "#docstring"},
                {"include": "#string"},
                {"include": "#annotation"},
                {"include": "#placeholder"},
                {"include": "#array-generic"},
                {"include": "#item-access"},
                {"include": "#tensor"},
                {"include": "#group"},
                {"include": "#keywords"},
                {"include": "#types"},
                {"include": "#calls"},
                {"include": "#operators"},
                {"include": "#numbers"},
                {"include": "#punctuation"},
            ],
        },
        "annotation": {
            "patterns": [
                {
                    "name": "meta.annotation.module",
                    "begin": rf"((@)({IDENT}))\s*(\()",
                    "beginCaptures": {
                        "1": {"name": "storage.type.annotation.module"},
                        "2": {"name": "punctuation.definition.annotation.module"},
                        "4": {"name": "punctuation.definition.arguments.begin.module"},
                    },
                    "end": r"\)",
                    "endCaptures": {"0": {"name": "punctuation.definition.arguments.end.module"}},
                    "patterns": [{"include": "#arguments"}],
                },
                {
                    "name": "meta.annotation.module",
                    "match": rf"((@)({IDENT}))",
                    "captures": {
                        "1": {"name": "storage.type.annotation.module"},
                        "2": {"name": "punctuation.definition.annotation.module"},
                    },
                },
            ],
        },
        "arguments": {
            "patterns": [
                {"include": "#comment"},
                {
                    "comment": "`name=value`, `name: value`: a keyword argument, a named element",
                    "match": rf"\b({IDENT})\s*(?==(?!=)|:(?!=))",
                    "captures": {"1": {"name": "variable.parameter.module"}},
                },
                {"include": "#expression"},
            ],
        },
        "array-generic": {
            "name": "meta.type.array.module",
            "begin": rf"\b({K.ARRAY})\s*(<)",
            "beginCaptures": {
                "1": {"name": "support.type.array.module"},
                "2": {"name": "punctuation.definition.generic.begin.module"},
            },
            "end": ">",
            "endCaptures": {"0": {"name": "punctuation.definition.generic.end.module"}},
            "patterns": [{"include": "#expression"}],
        },
        "item-access": {
            "name": "meta.item-access.module",
            "begin": rf"(?<={OPERAND_END})\[",
            "beginCaptures": {"0": {"name": "punctuation.definition.item-access.begin.module"}},
            "end": r"\]",
            "endCaptures": {"0": {"name": "punctuation.definition.item-access.end.module"}},
            "patterns": [
                {"name": "constant.other.ellipsis.module", "match": r"\.\.\."},
                {"include": "#expression"},
            ],
        },
        "tensor": {
            "comment": "[B, T, C, bf16]: a tensor type or shape (and a list: the same syntax)",
            "name": "meta.type.tensor.module",
            "begin": r"\[",
            "beginCaptures": {"0": {"name": "punctuation.definition.tensor.begin.module"}},
            "end": r"\]",
            "endCaptures": {"0": {"name": "punctuation.definition.tensor.end.module"}},
            "patterns": [
                {
                    "comment": "[*, M, K]: leading dims; [*_rstd]: a wildcard in save lists",
                    "match": r"(?:(?<=\[)|(?<=,))\s*(\*)",
                    "captures": {"1": {"name": "keyword.operator.variadic.module"}},
                },
                {"include": "#expression"},
            ],
        },
        "group": {
            "name": "meta.group.module",
            "begin": r"\(",
            "beginCaptures": {"0": {"name": "punctuation.parenthesis.begin.module"}},
            "end": r"\)",
            "endCaptures": {"0": {"name": "punctuation.parenthesis.end.module"}},
            "patterns": [{"include": "#arguments"}],
        },
        "keywords": {
            "patterns": [
                {"name": "keyword.control.conditional.module",
                 "match": rf"\b{words(K.CONDITIONALS)}\b"},
                {"name": "keyword.operator.logical.module",
                 "match": rf"\b{words(K.LOGICAL_OPERATORS)}\b|&&|\|\||!(?!=)"},
                {"name": "constant.language.boolean.module", "match": rf"\b{words(K.BOOLEANS)}\b"},
                {"name": "constant.language.none.module", "match": rf"\b{K.NONE}\b"},
                {"name": "variable.language.saved.module", "match": r"\bsaved\b(?=\s*\.)"},
            ],
        },
        "types": {
            "patterns": [
                {"name": "support.type.dtype.module", "match": rf"\b{words(K.DTYPES)}\b"},
                {"name": "support.type.scalar.module", "match": rf"\b{words(K.SCALAR_TYPES)}\b"},
            ],
        },
        "calls": {
            "patterns": [
                {
                    "comment": "primitives: generated from the op table (std/primitives/*.module)",
                    "name": "support.function.primitive.module",
                    "match": rf"(?<![\w.]){primitives}(?=\s*\()",
                },
                {"name": "entity.name.type.call.module", "match": r"\b[A-Z][A-Za-z0-9_]*(?=\s*\()"},
                {"name": "entity.name.function.call.module", "match": rf"\b{IDENT}(?=\s*\()"},
            ],
        },
        "operators": {
            "patterns": [
                {"name": "keyword.operator.flow.module", "match": "->"},
                {"name": "keyword.operator.array.module", "match": "\u00d7"},
                {
                    "comment": "[n] x Block: `x` is the array operator only right after an operand",
                    "match": rf"(?<={OPERAND_END})\s+(x)(?=\s+[A-Z\[(])",
                    "captures": {"1": {"name": "keyword.operator.array.module"}},
                },
                {"name": "constant.other.ellipsis.module", "match": r"\.\.\."},
                {"name": "keyword.operator.arithmetic.module", "match": r"\*\*|//|[-+*/%]"},
                {"name": "keyword.operator.comparison.module", "match": r"==|!=|<=|>=|<|>"},
                {"name": "keyword.operator.assignment.module", "match": "="},
                {"name": "keyword.operator.optional.module", "match": r"\?"},
            ],
        },
        "numbers": {
            "patterns": [
                {"name": "constant.numeric.float.module",
                 "match": r"\b\d[\d_]*(?:\.\d[\d_]*(?:[eE][+-]?\d[\d_]*)?|[eE][+-]?\d[\d_]*)\b"},
                {"name": "constant.numeric.integer.module", "match": r"\b\d[\d_]*\b"},
            ],
        },
        "punctuation": {
            "patterns": [
                {"name": "punctuation.separator.comma.module", "match": ","},
                {"name": "punctuation.separator.colon.module", "match": ":"},
                {"name": "punctuation.accessor.module", "match": r"\."},
            ],
        },
    }
    return {
        "$schema": "https://raw.githubusercontent.com/martinring/tmlanguage/master/tmlanguage.json",
        "information_for_contributors": [
            "GENERATED by grammar/generate_tmlanguage.py from modulec/highlight/keywords.py",
            "and the op table (std/primitives/*.module). Do not edit: edit the generator.",
        ],
        "name": "Module DSL",
        "scopeName": "source.module",
        "fileTypes": ["module"],
        "patterns": [
            {"include": "#comment"},
            {"include": "#docstring"},
            {"include": "#import"},
            {"include": "#from-import"},
            {"include": "#declaration"},
            {"include": "#impl-block"},
            {"include": "#section"},
            {"include": "#key"},
            {"include": "#binding"},
            {"include": "#list-dash"},
            {"include": "#expression"},
        ],
        "repository": repository,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    text = render()
    stale = [p for p in OUTPUTS if not p.is_file() or p.read_text(encoding="utf-8") != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(REPO)} is out of date: run python "
                  "grammar/generate_tmlanguage.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
