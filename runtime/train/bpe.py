"""A byte-level BPE tokenizer trained with `tokenizers` (GPT-2's scheme: any UTF-8 text
encodes, no unknown token), saved as a HuggingFace tokenizer folder that `modulec data`
and `transformers.AutoTokenizer` load: `tokenizer.json` and `tokenizer_config.json`
(its end-of-text token `<|endoftext|>`, id 0). Used by benchmarks/data/make_corpus.py
and the tests."""

from __future__ import annotations

import json
from pathlib import Path

EOS = "<|endoftext|>"


def train_bpe(texts, vocab_size: int, folder, min_frequency: int = 2) -> Path:
    """Train on `texts` (an iterable of documents) and save to `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS,
              "bos_token": EOS, "unk_token": None, "model_max_length": 1 << 20}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                                  encoding="utf-8")
    return folder
