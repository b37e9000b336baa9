"""`modulec data INPUT... -o tokens.bin --tokenizer DIR`: text and JSONL documents to the
token file `modulec train` reads (runtime/train/data.py: the ids of every document,
concatenated, little-endian uint16 or uint32), with a HuggingFace tokenizer from a local
folder (no network).

- A `.jsonl` input holds one JSON object per line, the document under `--field` (default
  `text`); any other input is one document (UTF-8 text). `--format` overrides the suffix.
- The tokenizer: the folder's `tokenizer.json` through `tokenizers` (fast, no
  transformers import), else `transformers.AutoTokenizer` with `local_files_only`. Each
  document is encoded without the tokenizer's special-token template (no BOS), then the
  document separator is appended: `--doc-sep eos` (default: the tokenizer's end-of-text
  token), an id, or `none`.
- dtype: uint16 when every id fits (vocab <= 65536), else uint32 (the trainer's default
  rule); a `--dtype-tokens` too small for the vocabulary is an error.
- The file is written to a temporary file beside the output and renamed into place:
  an error or interruption leaves no partial output.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from modulec.files import atomic_write  # runtime.hf_weights.stream's, without importing torch
from runtime.errors import RuntimeUserError

LIMITS = {"uint16": 65536, "uint32": 2 ** 32}
ENCODE_BATCH = 256  # documents per encode_batch call


@dataclass
class Tokenizer:
    """A loaded tokenizer: `encode(texts) -> list of id lists`, its vocabulary size and
    end-of-text id (None when it has none)."""

    encode: object
    vocab_size: int
    eos_id: int | None
    kind: str = "tokenizers"


@dataclass
class Summary:
    documents: int = 0
    tokens: int = 0
    inputs: list = field(default_factory=list)


def load_tokenizer(folder) -> Tokenizer:
    folder = Path(folder)
    if not folder.is_dir():
        where = "does not exist" if not folder.exists() else "is not a folder"
        raise RuntimeUserError(f"--tokenizer {folder} {where}",
                               help=["give the folder of a HuggingFace tokenizer "
                                     "(tokenizer.json, tokenizer_config.json)"])
    if (folder / "tokenizer.json").is_file():
        return _fast(folder)
    return _transformers(folder)


def _fast(folder: Path) -> Tokenizer:
    from tokenizers import Tokenizer as Fast

    try:
        tokenizer = Fast.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # noqa: BLE001 - the library's parse errors have no common type
        raise RuntimeUserError(f"cannot read {folder / 'tokenizer.json'}: {exc}") from None
    eos = _eos_token(folder)
    eos_id = tokenizer.token_to_id(eos) if eos else None

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

    return Tokenizer(encode, tokenizer.get_vocab_size(with_added_tokens=True), eos_id)


def _eos_token(folder: Path) -> str | None:
    """The end-of-text token named by tokenizer_config.json or special_tokens_map.json."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise RuntimeUserError(f"cannot read {path}: {exc}") from None
        eos = data.get("eos_token") if isinstance(data, dict) else None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
    return None


def _transformers(folder: Path) -> Tokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise RuntimeUserError(f"{folder} has no tokenizer.json, and reading its other "
                               "tokenizer files needs transformers",
                               help=["pip install transformers, or save the tokenizer "
                                     "with tokenizer.json"]) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise RuntimeUserError(f"{folder} holds no tokenizer transformers can load: "
                               f"{str(exc).splitlines()[0]}",
                               help=["the folder needs tokenizer.json, or a "
                                     "tokenizer_config.json with the tokenizer's files"]) \
            from None

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return Tokenizer(encode, len(tokenizer), tokenizer.eos_token_id, "transformers")


def separator(doc_sep: str, tokenizer: Tokenizer) -> int | None:
    """The id appended after each document (None: nothing)."""
    if doc_sep == "none":
        return None
    if doc_sep == "eos":
        if tokenizer.eos_id is None:
            raise RuntimeUserError("the tokenizer has no end-of-text token (eos_token)",
                                   help=["give the separator's id: --doc-sep ID, or "
                                         "--doc-sep none"])
        return int(tokenizer.eos_id)
    if not doc_sep.isdigit():
        raise RuntimeUserError(f"--doc-sep {doc_sep}: give eos, none or a token id")
    value = int(doc_sep)
    if value >= tokenizer.vocab_size:
        raise RuntimeUserError(f"--doc-sep {value} is not below the vocabulary size "
                               f"{tokenizer.vocab_size}")
    return value


def token_dtype(choice: str, vocab_size: int) -> str:
    if choice == "auto":
        return "uint16" if vocab_size <= LIMITS["uint16"] else "uint32"
    if vocab_size > LIMITS[choice]:
        raise RuntimeUserError(f"the tokenizer's vocabulary has {vocab_size:,} ids: more "
                               f"than {choice} holds ({LIMITS[choice]:,})",
                               help=["use --dtype-tokens uint32 (or leave it out: auto)"])
    return choice


def documents(path: Path, kind: str, text_field: str):
    """(text, bytes read so far) of each document of one input."""
    if kind == "text":
        text = _read_text(path)
        yield text, path.stat().st_size
        return
    done = 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            done += len(raw)
            if not raw.strip():
                continue
            yield _field(path, number, raw, text_field), done


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RuntimeUserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})",
                               help=["convert it to UTF-8, or give JSONL with --format "
                                     "jsonl"]) from None


def _field(path: Path, number: int, raw: bytes, text_field: str) -> str:
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RuntimeUserError(f"{path}:{number}: not a JSON line: {exc}",
                               help=["a .jsonl input holds one JSON object per line"]) \
            from None
    if not isinstance(record, dict):
        raise RuntimeUserError(f"{path}:{number}: a JSON {type(record).__name__}, not an "
                               "object", help=["each line holds one object, the document "
                                               f"under \"{text_field}\""])
    value = record.get(text_field)
    if not isinstance(value, str):
        what = "no field" if text_field not in record else \
            f"a {type(value).__name__} under"
        keys = ", ".join(list(record)[:5])
        raise RuntimeUserError(f"{path}:{number}: {what} \"{text_field}\" (a string "
                               "was expected)", help=[f"the line's fields: {keys}; choose "
                                                      "one with --field NAME"])
    return value


def input_kind(path: Path, choice: str) -> str:
    if choice != "auto":
        return choice
    return "jsonl" if path.suffix.lower() in (".jsonl", ".ndjson") else "text"


def check_inputs(inputs: list[Path]) -> None:
    for path in inputs:
        if not path.is_file():
            where = "is a directory" if path.is_dir() else "does not exist" \
                if not path.exists() else "is not a regular file"
            raise RuntimeUserError(f"input {path} {where}")


def prepare(*, inputs, output, tokenizer, text_field="text", doc_sep="eos",
            dtype_tokens="auto", fmt="auto", progress=None) -> str:
    inputs = [Path(p) for p in inputs]
    check_inputs(inputs)
    loaded = load_tokenizer(tokenizer)
    sep = separator(doc_sep, loaded)
    dtype = token_dtype(dtype_tokens, loaded.vocab_size)
    output = Path(output)
    if not output.parent.is_dir():
        raise RuntimeUserError(f"-o {output}: folder {output.parent} does not exist")
    bar = progress if progress is not None else _progress(inputs)
    summary = Summary()

    def tokenize_into(temp) -> None:
        with open(temp, "wb") as handle, bar:
            for path in inputs:
                _one_input(path, input_kind(path, fmt), text_field, loaded, sep, dtype,
                           handle, bar, summary)
        if summary.tokens == 0:
            raise RuntimeUserError("the inputs hold no tokens: nothing to write")

    atomic_write(output, tokenize_into)
    sep_text = "no separator" if sep is None else f"separator id {sep}"
    return (f"wrote {summary.tokens:,} tokens ({summary.documents:,} documents, "
            f"{sep_text}) to {output} as {dtype}; vocabulary {loaded.vocab_size:,}")


def _one_input(path: Path, kind: str, text_field: str, tokenizer: Tokenizer,
               sep: int | None, dtype: str, handle, bar, summary: Summary) -> None:
    batch: list[str] = []
    done = 0
    for text, done in documents(path, kind, text_field):
        batch.append(text)
        if len(batch) == ENCODE_BATCH:
            _write(tokenizer.encode(batch), sep, dtype, handle, summary)
            bar.advance(path, done)
            batch = []
    if batch:
        _write(tokenizer.encode(batch), sep, dtype, handle, summary)
    bar.advance(path, path.stat().st_size)


def _write(encoded: list[list[int]], sep: int | None, dtype: str, handle,
           summary: Summary) -> None:
    ids: list[int] = []
    for doc in encoded:
        ids.extend(doc)
        if sep is not None:
            ids.append(sep)
    array = np.asarray(ids, dtype=np.int64)
    if array.size and int(array.max()) >= LIMITS[dtype]:  # an added token past the vocab
        raise RuntimeUserError(f"token id {int(array.max())} does not fit {dtype}",
                               help=["use --dtype-tokens uint32"])
    array.astype(np.dtype(dtype).newbyteorder("<")).tofile(handle)
    summary.documents += len(encoded)
    summary.tokens += int(array.size)


class _Quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def advance(self, path, done: int) -> None:
        return None


class _Bar(_Quiet):
    """A rich progress bar over the bytes of the inputs (stderr, a terminal only)."""

    def __init__(self, inputs: list[Path]):
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                                   TimeRemainingColumn)

        self.total = sum(p.stat().st_size for p in inputs)
        self.before = {}
        start = 0
        for path in inputs:
            self.before[path] = start
            start += path.stat().st_size
        self.bar = Progress(TextColumn("tokenize"), BarColumn(), DownloadColumn(),
                            TimeRemainingColumn(), console=Console(stderr=True))
        self.task = self.bar.add_task("tokenize", total=self.total or 1)

    def __enter__(self):
        self.bar.start()
        return self

    def __exit__(self, *exc):
        self.bar.stop()

    def advance(self, path, done: int) -> None:
        self.bar.update(self.task, completed=self.before[path] + done)


def _progress(inputs: list[Path]):
    return _Bar(inputs) if sys.stderr.isatty() else _Quiet()

