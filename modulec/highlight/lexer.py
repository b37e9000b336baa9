"""Pygments lexer for the Module DSL (`*.module`).

The token classes follow the TextMate grammar (grammar/module.tmLanguage.json): both take
their word lists from `modulec.highlight.keywords`, and the primitive names from the op
table's file names (std/primitives/*.module), read once at import without lark or the
parser. Registered with Pygments through the `pygments.lexers` entry point
(`module = "modulec.highlight.lexer:ModuleLexer"`).

Pygments' JSON lexer also claims `*.module` (Gradle module metadata). For a file name alone
ours wins on `priority`; with the text, on `analyse_text` (DSL text scores high). JSON text
scores 0 here, but the JSON lexer scores every text 0 and Pygments breaks the tie by class
name, so Gradle metadata named `*.module` needs the JSON lexer asked for by name.
"""

from __future__ import annotations

import re

from pygments.lexer import RegexLexer, bygroups, default, include, words
from pygments.token import (Comment, Keyword, Name, Number, Operator, Punctuation, String,
                            Whitespace)

from modulec.highlight import keywords as K

__all__ = ["ModuleLexer"]

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_IMPL_TEXT = r"[^\s#](?:[^#\r\n]*[^\s#])?"
_OPERAND_END = r"[A-Za-z0-9_)\]]"
_NAMED_VALUE = rf"(?:([ \t]*)({_IDENT})([ \t]*)(:)(?=[ \t]))?"

# analyse_text: a declaration header, an import of a dotted path, a flow.
_DOTTED = rf"{_IDENT}(?:\.{_IDENT})*"
_DECLARATION_LINE = re.compile(rf"^(?:abstract[ \t]+)?{K.words_regex(K.DECLARATION_KINDS)}"
                               rf"[ \t]+{_IDENT}[ \t]*(?:\(|:|extends\b)", re.MULTILINE)
_SECTION_LINE = re.compile(rf"^[ \t]+{K.words_regex(K.SECTIONS + (K.IMPL,))}[ \t]*:",
                           re.MULTILINE)
_IMPORT_LINE = re.compile(rf"^(?:import[ \t]+{_DOTTED}|from[ \t]+{_DOTTED}[ \t]+import\b)",
                          re.MULTILINE)
_FLOW = re.compile(rf"(?:{_IDENT}|\))[ \t]*->[ \t]*(?:{_IDENT}|\()")

# The lines of an `impl:` block: `name: free text  # comment`, or blank / comment only.
_IMPL_ENTRY = re.compile(
    rf"([ \t]*)({_IDENT})([ \t]*)(:)([ \t]*)({_IMPL_TEXT})?([ \t]*)(#[^\n]*)?(\n?)$")
_IMPL_ENTRY_TOKENS = (Whitespace, Name.Attribute, Whitespace, Punctuation, Whitespace,
                      String.Other, Whitespace, Comment.Single, Whitespace)
_BLANK = re.compile(r"([ \t\n]*)(#[^\n]*)?(\n?)$")
_BLANK_TOKENS = (Whitespace, Comment.Single, Whitespace)


def _impl_block(lexer, match):
    """`impl:` and the lines indented under it: keys and free text (decisions.md)."""
    yield from bygroups(Whitespace, Keyword.Reserved, Whitespace, Punctuation, Whitespace,
                        String.Other, Whitespace, Comment.Single)(lexer, match)
    body = match.group(9)
    offset = match.start(9)
    for line in re.finditer(r"[^\n]*\n?", body):
        text = line.group()
        if not text:
            continue
        start = offset + line.start()
        for pattern, tokens in ((_IMPL_ENTRY, _IMPL_ENTRY_TOKENS), (_BLANK, _BLANK_TOKENS)):
            found = pattern.match(text)
            if found:
                for group, token in enumerate(tokens, 1):
                    if found.group(group):
                        yield start + found.start(group), token, found.group(group)
                break
        else:  # a line the grammar rejects: still free text, never an error token
            yield start, String.Other, text


class ModuleLexer(RegexLexer):
    """Lexer for the Module DSL, the text language for neural networks compiled by modulec."""

    name = "Module DSL"
    aliases = ["module", "moduledsl"]
    filenames = ["*.module"]
    mimetypes = ["text/x-module-dsl"]
    # Above the JSON lexer's 0: it also claims *.module (Gradle module metadata).
    priority = 0.5

    flags = re.MULTILINE

    tokens = {
        "root": [
            (r"\n", Whitespace),
            include("comments"),
            (r"^(import)\b", Keyword.Namespace, "import"),
            (r"^(from)\b", Keyword.Namespace, "from"),
            (rf"^(?:({K.words_regex(K.DECLARATION_MODIFIERS)})([ \t]+))?"
             rf"({K.words_regex(K.DECLARATION_KINDS)})(?:([ \t]+)({_IDENT}))?(?=[\s(:])",
             bygroups(Keyword.Declaration, Whitespace, Keyword.Declaration, Whitespace,
                      Name.Class), "declaration"),
            (rf"^([ \t]*)({K.IMPL})([ \t]*)(:)([ \t]*)({_IMPL_TEXT})?([ \t]*)(#[^\n]*)?"
             rf"((?:\n(?:[ \t]*(?:#[^\n]*)?(?=\n|\Z)|\1[ \t]+[^\n]*))*)", _impl_block),
            (rf"^([ \t]*)(?:(-)([ \t]+))?({K.words_regex(K.SECTIONS)})([ \t]*)(:){_NAMED_VALUE}",
             bygroups(Whitespace, Punctuation, Whitespace, Keyword.Reserved, Whitespace,
                      Punctuation, Whitespace, Name.Variable, Whitespace, Punctuation)),
            (rf"^([ \t]*)(?:(-)([ \t]+))?(?:(\+)([ \t]*))?(?!{K.words_regex(K.CONDITIONALS)}\b)"
             rf"({_IDENT})([ \t]*)(:)(?!=){_NAMED_VALUE}",
             bygroups(Whitespace, Punctuation, Whitespace, Operator, Whitespace, Name.Attribute,
                      Whitespace, Punctuation, Whitespace, Name.Variable, Whitespace,
                      Punctuation)),
            (rf"^([ \t]*)(?:(-)([ \t]+))?({_IDENT})(?=[ \t]*=(?!=))",
             bygroups(Whitespace, Punctuation, Whitespace, Name.Variable)),
            (r"^([ \t]*)(-)(?=[ \t]|$)", bygroups(Whitespace, Punctuation)),
            include("expression"),
        ],
        "comments": [
            (r"#[^\n]*", Comment.Single),
            (r'"""[\s\S]*?"""', String.Doc),
            (r'"""[\s\S]*', String.Doc),  # unterminated: to the end, as the parser reads it
        ],
        "whitespace": [
            (r"\s+", Whitespace),
            include("comments"),
        ],
        # ------------------------------------------------------------------ imports
        "import": [
            (r"\n", Whitespace, "#pop"),
            (r"[ \t]+", Whitespace),
            (r"#[^\n]*", Comment.Single),
            (r"\bas\b", Keyword.Namespace),
            (r"\{", Punctuation, "import-names"),
            (r"\.", Punctuation),
            (_IDENT, Name.Namespace),
            default("#pop"),
        ],
        "from": [
            (r"\n", Whitespace, "#pop"),
            (r"[ \t]+", Whitespace),
            (r"#[^\n]*", Comment.Single),
            (r"\bimport\b", Keyword.Namespace, ("#pop", "from-names")),
            (r"\.", Punctuation),
            (_IDENT, Name.Namespace),
            default("#pop"),
        ],
        "from-names": [
            (r"\n", Whitespace, "#pop"),
            (r"[ \t]+", Whitespace),
            (r"#[^\n]*", Comment.Single),
            (r"\(", Punctuation, "import-names"),
            (r"\bas\b", Keyword.Namespace),
            (r",", Punctuation),
            (_IDENT, Name.Class),
            default("#pop"),
        ],
        "import-names": [
            (r"[\)\}]", Punctuation, "#pop"),
            (r"\s+", Whitespace),
            (r"#[^\n]*", Comment.Single),
            (r"\bas\b", Keyword.Namespace),
            (r",", Punctuation),
            (_IDENT, Name.Class),
            default("#pop"),
        ],
        # ------------------------------------------------------------------ declarations
        "declaration": [
            (r":", Punctuation, "#pop"),
            (r"\n", Whitespace, "#pop"),
            (r"[ \t]+", Whitespace),
            (r"#[^\n]*", Comment.Single),
            (r"\(", Punctuation, "parameters"),
            (rf"\b({K.words_regex(K.INHERITANCE)})([ \t]+)({_IDENT})([ \t]*)(\()",
             bygroups(Keyword.Declaration, Whitespace, Name.Class, Whitespace, Punctuation),
             "group"),  # extends Base(args): arguments, not parameters
            (rf"\b({K.words_regex(K.INHERITANCE)})\b(?:([ \t]+)({_IDENT}))?",
             bygroups(Keyword.Declaration, Whitespace, Name.Class)),
            include("expression"),
        ],
        "parameters": [  # expecting a parameter name
            (r"\)", Punctuation, "#pop"),
            include("whitespace"),
            (r",", Punctuation),
            (_IDENT, Name.Variable, "parameter"),
            default("parameter"),
        ],
        "parameter": [  # its type and default, up to the next `,` or the closing `)`
            (r",", Punctuation, "#pop"),
            (r"\)", Punctuation, "#pop:2"),
            include("whitespace"),
            (r"[\(\[]", Punctuation, "group"),
            include("expression"),
        ],
        "group": [  # brackets inside a declaration's parameters: newlines do not end them
            (r"[\)\]]", Punctuation, "#pop"),
            include("whitespace"),
            (r"[\(\[]", Punctuation, "#push"),
            include("expression"),
        ],
        # ------------------------------------------------------------------ expressions
        "expression": [
            include("comments"),
            (rf"(?<={_OPERAND_END})([ \t]+)(x)(?=[ \t]+[A-Z\[(])",
             bygroups(Whitespace, Operator.Word)),
            (r"\s+", Whitespace),
            (r'"', String.Double, "string"),
            (rf"@{_IDENT}", Name.Decorator),
            (rf"\{{{_IDENT}\}}", String.Interpol),
            (rf"({K.ARRAY})([ \t]*)(<)", bygroups(Keyword.Type, Whitespace, Punctuation)),
            (words(K.CONDITIONALS, suffix=r"\b"), Keyword),
            (words(K.LOGICAL_OPERATORS, suffix=r"\b"), Operator.Word),
            (words(K.BOOLEANS + (K.NONE,), suffix=r"\b"), Keyword.Constant),
            (words(K.DTYPES + K.SCALAR_TYPES, suffix=r"\b"), Keyword.Type),
            (r"saved\b(?=[ \t]*\.)", Name.Builtin.Pseudo),
            (words(K.primitive_names(), prefix=r"(?<![\w.])", suffix=r"(?=[ \t]*\()"),
             Name.Builtin),
            (r"[A-Z][A-Za-z0-9_]*(?=[ \t]*\()", Name.Class),
            (rf"{_IDENT}(?=[ \t]*\()", Name.Function),
            (rf"({_IDENT})([ \t]*)(=)(?!=)", bygroups(Name.Variable, Whitespace, Operator)),
            (rf"({_IDENT})([ \t]*)(:)(?!=)(?=[ \t])",
             bygroups(Name.Variable, Whitespace, Punctuation)),
            (_IDENT, Name),
            (r"\d[\d_]*(?:\.\d[\d_]*(?:[eE][+-]?\d[\d_]*)?|[eE][+-]?\d[\d_]*)", Number.Float),
            (r"\d[\d_]*", Number.Integer),
            (r"->", Operator),
            (r"\.\.\.", Punctuation),
            (r"\*\*|//|==|!=|<=|>=|&&|\|\||[-+*/%<>=!?\u00d7]", Operator),
            (r"[()\[\]{},:.]", Punctuation),
        ],
        "string": [
            (r'"', String.Double, "#pop"),
            (r"\\.", String.Escape),
            (rf"\{{{_IDENT}\}}", String.Interpol),
            (r'[^"\\{\n]+', String.Double),
            (r"\{", String.Double),
            default("#pop"),  # unterminated at the end of the line
        ],
    }

    def analyse_text(text):
        """High for Module DSL text (declaration headers, sections, flows), 0 for JSON."""
        stripped = text.lstrip()
        if not stripped or stripped[0] in "{[":
            return 0.0
        score = 0.0
        if _DECLARATION_LINE.search(text):
            score += 0.6
        if _SECTION_LINE.search(text):
            score += 0.2
        if _FLOW.search(text):
            score += 0.2
        if _IMPORT_LINE.search(text) and score:
            score += 0.1
        return min(score, 1.0)
