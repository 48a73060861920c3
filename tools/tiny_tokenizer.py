"""What the make_*_tiny_tokenizer.py scripts share: a byte-level BPE learned from a corpus
after a model's own pre-tokenizer split, and their command line (`--out PATH`).

The scripts run from the repository root (`python tools/make_X_tiny_tokenizer.py`) and are
loaded by path in the tests, so each puts this folder on sys.path to import this module.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers


def byte_level_bpe(split: str, corpus: Iterable[str], vocab_size: int, *, min_frequency: int = 0,
                   normalizer: normalizers.Normalizer | None = None) -> Tokenizer:
    """A BPE over bytes (any text encodes, nothing is unknown) of `vocab_size` ids (the 256
    bytes, then merges), pre-tokenized by the regex `split` as the model's `tokenizer.json`
    does, trained on `corpus` (after `normalizer`, where one is given)."""
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def out_path(doc: str, default: Path, argv: list[str] | None = None) -> Path:
    """The file a script writes: `--out`, else `default`; `doc` is the script's docstring."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default)
    return parser.parse_args(argv).out
