"""Build a small real-text corpus, a BPE tokenizer and the token files for a `modulec
train` run, offline (docs/training.md, "A run on real text").

    python benchmarks/data/make_corpus.py OUT [--vocab 32000] [--max-mb 16]

writes OUT/tokenizer/ (byte-level BPE, `tokenizers`), OUT/train.bin and OUT/eval.bin
(uint16 ids, one `<|endoftext|>` after each document; written by `modulec data`),
OUT/train.jsonl and OUT/eval.jsonl (the documents) and OUT/manifest.json (sources, sizes,
sha256 of every output, the Python version).

The text: this Python's standard library source files (`.py`, tests left out) and its
`pydoc_data/topics.py` (the language reference's text), under the Python Software
Foundation License v2, which permits copying and derivative works with the licence kept;
plus this project's spec documents (docs/spec, shared/spec) when present. Nothing is
downloaded, and the corpus is not committed: the script regenerates it, so the same
Python version gives the same files. One document per source file; about 2% of the
documents, chosen by a hash of their path (not by their order), are the eval split. If
the files exceed `--max-mb` megabytes of text, a subset by the same hash is kept.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EVAL_PER_MILLE = 20
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


def sources() -> list[tuple[str, Path]]:
    """(name, path) of every document, in sorted order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = [(f"stdlib/{p.relative_to(stdlib)}", p) for p in sorted(stdlib.rglob("*.py"))
             if not SKIP_PARTS & set(p.relative_to(stdlib).parts)]
    for folder in (ROOT / "docs" / "spec", ROOT / "shared" / "spec",
                   ROOT.parent / "shared" / "spec"):
        if folder.is_dir():
            found += [(f"spec/{p.name}", p) for p in sorted(folder.glob("*.md"))]
    unique = {}
    for name, path in found:
        unique.setdefault(name, path)
    return sorted(unique.items())


def rank(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def documents(max_mb: float) -> list[tuple[str, str]]:
    docs = []
    for name, path in sources():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append((name, text))
    budget = max_mb * 1e6
    if sum(len(t) for _, t in docs) > budget:
        kept, size = set(), 0
        for name, text in sorted(docs, key=lambda d: rank(d[0])):
            if size + len(text) > budget:
                continue
            kept.add(name)
            size += len(text)
        docs = [d for d in docs if d[0] in kept]
    return docs


def write_jsonl(path: Path, docs) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for name, text in docs:
            handle.write(json.dumps({"source": name, "text": text}) + "\n")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-mb", type=float, default=16.0)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from runtime.train.bpe import train_bpe

    out = args.out.resolve()  # the `modulec data` runs below run in ROOT
    out.mkdir(parents=True, exist_ok=True)
    docs = documents(args.max_mb)
    evals = [d for d in docs if rank(d[0]) % 1000 < EVAL_PER_MILLE]
    train = [d for d in docs if rank(d[0]) % 1000 >= EVAL_PER_MILLE]
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "eval.jsonl", evals)
    print(f"{len(train)} train / {len(evals)} eval documents, "
          f"{sum(len(t) for _, t in docs) / 1e6:.1f} MB of text", flush=True)
    train_bpe((t for _, t in train), args.vocab, out / "tokenizer")
    for split in ("train", "eval"):
        subprocess.run([sys.executable, "-m", "modulec", "data", str(out / f"{split}.jsonl"),
                        "-o", str(out / f"{split}.bin"), "--tokenizer", str(out / "tokenizer"),
                        "--dtype-tokens", "uint16"], check=True, cwd=ROOT)
    manifest = {"python": sys.version.split()[0], "vocab": args.vocab,
                "max_mb": args.max_mb, "documents": {"train": len(train), "eval": len(evals)},
                "licence": "Python standard library: PSF License v2; spec: this project's",
                "files": {str(p.relative_to(out)): {"bytes": p.stat().st_size,
                                                    "sha256": sha256(p)}
                          for p in sorted(out.rglob("*"))
                          if p.is_file() and p.name != "manifest.json"}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
