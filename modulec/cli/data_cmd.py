"""`modulec data INPUT... -o tokens.bin --tokenizer DIR`: text / JSONL documents to the
token file `modulec train --data` reads (runtime/train/prepare.py; docs/training.md,
"Data"). Neither torch nor transformers is imported unless the tokenizer needs it."""

from __future__ import annotations

from pathlib import Path

import click


def data_command(guarded):
    @click.command("data")
    @click.argument("inputs", metavar="INPUT...", nargs=-1, required=True,
                    type=click.Path(path_type=Path))
    @click.option("-o", "--output", required=True, type=click.Path(dir_okay=False,
                                                                   path_type=Path),
                  help="The token file to write (flat little-endian ids).")
    @click.option("--tokenizer", required=True, type=click.Path(path_type=Path),
                  metavar="DIR", help="A HuggingFace tokenizer folder (tokenizer.json, "
                                      "tokenizer_config.json); read locally, no network.")
    @click.option("--field", "text_field", default="text", show_default=True,
                  help="The JSONL field holding each document's text.")
    @click.option("--format", "fmt", type=click.Choice(["auto", "text", "jsonl"]),
                  default="auto", show_default=True,
                  help="auto: .jsonl / .ndjson inputs are JSONL, others are one text "
                       "document each.")
    @click.option("--doc-sep", default="eos", show_default=True, metavar="eos|ID|none",
                  help="The id appended after each document (eos: the tokenizer's).")
    @click.option("--dtype-tokens", type=click.Choice(["auto", "uint16", "uint32"]),
                  default="auto", show_default=True,
                  help="How ids are stored (auto: uint16 when the vocabulary fits).")
    @guarded
    def data(inputs, output, tokenizer, text_field, fmt, doc_sep, dtype_tokens) -> int:
        """Tokenize text and JSONL files into a token file for `modulec train`.

        \b
        Example:
          modulec data corpus/*.jsonl -o tokens.bin --tokenizer tokenizer/
        """
        from runtime.errors import RuntimeUserError
        from runtime.train.prepare import prepare

        try:
            summary = prepare(inputs=inputs, output=output, tokenizer=tokenizer,
                              text_field=text_field, doc_sep=doc_sep,
                              dtype_tokens=dtype_tokens, fmt=fmt)
        except RuntimeUserError as exc:
            click.echo(f"error: {exc.message}", err=True)
            for line in exc.help:
                click.echo(f"  = help: {line}", err=True)
            return 1
        click.echo(summary)
        return 0

    return data
