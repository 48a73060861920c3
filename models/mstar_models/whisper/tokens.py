"""Whisper's token layout, its languages and the tokenizer.

The layout (whisper-large-v3, its `generation_config.json` and `added_tokens`): text ids
below 50257, then `<|endoftext|>` 50257, `<|startoftranscript|>` 50258, one token per
language from 50259 (100 of them, in `LANGUAGES` order), `<|translate|>`, `<|transcribe|>`,
`<|startoflm|>`, `<|startofprev|>`, `<|nospeech|>`, `<|notimestamps|>` and then the
1501 timestamps `<|0.00|>` .. `<|30.00|>` every 20 ms. Every id is derived from the
`sot`, `languages` and `vocab` config values, so a config with fewer languages (large-v2's
99) shifts them as the checkpoints do.

Tokenizer: the checkpoint's own `tokenizer.json` (the `tokenizers` library, no
`transformers` needed) when the weights source is a folder holding one; otherwise a
byte-level tokenizer built here (each byte one token, at GPT-2's ids of the single bytes,
0..255, and no merges; the other text ids decode to `<|tN|>`), so tests and benchmarks with random weights still encode prompts and
decode what they generate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from mstar_models.tokenizers import load_tokenizer
from mstar_runtime.ops import node

# whisper-large-v3's 100 languages in token order (transformers' tokenization_whisper.LANGUAGES)
LANGUAGES = (
    ("en", "english"), ("zh", "chinese"), ("de", "german"), ("es", "spanish"), ("ru", "russian"),
    ("ko", "korean"), ("fr", "french"), ("ja", "japanese"), ("pt", "portuguese"), ("tr", "turkish"),
    ("pl", "polish"), ("ca", "catalan"), ("nl", "dutch"), ("ar", "arabic"), ("sv", "swedish"),
    ("it", "italian"), ("id", "indonesian"), ("hi", "hindi"), ("fi", "finnish"), ("vi", "vietnamese"),
    ("he", "hebrew"), ("uk", "ukrainian"), ("el", "greek"), ("ms", "malay"), ("cs", "czech"),
    ("ro", "romanian"), ("da", "danish"), ("hu", "hungarian"), ("ta", "tamil"), ("no", "norwegian"),
    ("th", "thai"), ("ur", "urdu"), ("hr", "croatian"), ("bg", "bulgarian"), ("lt", "lithuanian"),
    ("la", "latin"), ("mi", "maori"), ("ml", "malayalam"), ("cy", "welsh"), ("sk", "slovak"),
    ("te", "telugu"), ("fa", "persian"), ("lv", "latvian"), ("bn", "bengali"), ("sr", "serbian"),
    ("az", "azerbaijani"), ("sl", "slovenian"), ("kn", "kannada"), ("et", "estonian"), ("mk", "macedonian"),
    ("br", "breton"), ("eu", "basque"), ("is", "icelandic"), ("hy", "armenian"), ("ne", "nepali"),
    ("mn", "mongolian"), ("bs", "bosnian"), ("kk", "kazakh"), ("sq", "albanian"), ("sw", "swahili"),
    ("gl", "galician"), ("mr", "marathi"), ("pa", "punjabi"), ("si", "sinhala"), ("km", "khmer"),
    ("sn", "shona"), ("yo", "yoruba"), ("so", "somali"), ("af", "afrikaans"), ("oc", "occitan"),
    ("ka", "georgian"), ("be", "belarusian"), ("tg", "tajik"), ("sd", "sindhi"), ("gu", "gujarati"),
    ("am", "amharic"), ("yi", "yiddish"), ("lo", "lao"), ("uz", "uzbek"), ("fo", "faroese"),
    ("ht", "haitian creole"), ("ps", "pashto"), ("tk", "turkmen"), ("nn", "nynorsk"), ("mt", "maltese"),
    ("sa", "sanskrit"), ("lb", "luxembourgish"), ("my", "myanmar"), ("bo", "tibetan"), ("tl", "tagalog"),
    ("mg", "malagasy"), ("as", "assamese"), ("tt", "tatar"), ("haw", "hawaiian"), ("ln", "lingala"),
    ("ha", "hausa"), ("ba", "bashkir"), ("jw", "javanese"), ("su", "sundanese"), ("yue", "cantonese"),
)

LANGUAGE_CODES = tuple(code for code, _ in LANGUAGES)
LANGUAGE_NAMES = dict(LANGUAGES)
# OpenAI's API and transformers accept a language's name as well as its code
LANGUAGE_BY_NAME = {name: code for code, name in LANGUAGES}
TIME_PRECISION = 0.02  # seconds per timestamp token
CHECKPOINT_TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class Layout:
    """The special token ids of one Whisper vocabulary."""

    eot: int
    sot: int
    languages: int  # how many language tokens follow sot
    vocab: int

    @property
    def first_language(self) -> int:
        return self.sot + 1

    @property
    def translate(self) -> int:
        return self.sot + 1 + self.languages

    @property
    def transcribe(self) -> int:
        return self.translate + 1

    @property
    def startoflm(self) -> int:
        return self.translate + 2

    @property
    def startofprev(self) -> int:
        return self.translate + 3

    @property
    def nospeech(self) -> int:
        return self.translate + 4

    @property
    def notimestamps(self) -> int:
        return self.translate + 5

    @property
    def timestamp_begin(self) -> int:
        return self.notimestamps + 1

    def language_token(self, code: str) -> int:
        return self.first_language + LANGUAGE_CODES.index(code)

    def language_of(self, token: int) -> str:
        """The code of a language token ("" for any other id)."""
        i = token - self.first_language
        return LANGUAGE_CODES[i] if 0 <= i < self.languages else ""

    def task_token(self, task: str) -> int:
        return self.translate if task == "translate" else self.transcribe


def layout_of(spec: node.NodeSpec) -> Layout:
    """The layout from the model config (`eot`, `sot`, `languages`, `vocab`), checked."""
    c = spec.config
    try:
        layout = Layout(int(c["eot"]), int(c["sot"]), int(c["languages"]), int(c["vocab"]))
    except (KeyError, TypeError, ValueError) as e:
        raise node.NodeError(f"node '{spec.name}': the Whisper token layout needs config values eot, sot, "
                             f"languages and vocab ({e})") from None
    if not 1 <= layout.languages <= len(LANGUAGE_CODES):
        raise node.NodeError(f"node '{spec.name}': languages must be 1..{len(LANGUAGE_CODES)}, got {layout.languages}")
    if layout.timestamp_begin + 1501 > layout.vocab:
        raise node.NodeError(f"node '{spec.name}': vocab {layout.vocab} has no room for the 1501 timestamp tokens "
                             f"after {layout.timestamp_begin}")
    return layout


def special_tokens(layout: Layout) -> dict[int, str]:
    """Every special id's text, as the checkpoint's added tokens spell them."""
    names = {layout.eot: "<|endoftext|>", layout.sot: "<|startoftranscript|>"}
    for i in range(layout.languages):
        names[layout.first_language + i] = f"<|{LANGUAGE_CODES[i]}|>"
    names.update({layout.translate: "<|translate|>", layout.transcribe: "<|transcribe|>",
                  layout.startoflm: "<|startoflm|>", layout.startofprev: "<|startofprev|>",
                  layout.nospeech: "<|nospeech|>", layout.notimestamps: "<|notimestamps|>"})
    for i in range(layout.vocab - layout.timestamp_begin):
        names[layout.timestamp_begin + i] = f"<|{i * TIME_PRECISION:.2f}|>"
    return names


def byte_tokenizer(layout: Layout) -> Tokenizer:
    """The fallback tokenizer of the module docstring (no checkpoint files needed)."""
    # GPT-2's byte-level characters by code point are GPT-2's own ids 0..255 of the single bytes
    # (the printable bytes stand for themselves, the others were moved to 256 + their rank)
    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(chars)}
    vocab.update({f"<|t{i}|>": i for i in range(len(chars), layout.eot)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = special_tokens(layout)
    tok.add_special_tokens([AddedToken(specials[i], special=True) for i in sorted(specials)])
    return tok


def checkpoint_tokenizer(source: str) -> Tokenizer | None:
    """The checkpoint folder's tokenizer.json, or None when the source has none."""
    path = Path(source) / CHECKPOINT_TOKENIZER
    return load_tokenizer(path) if path.is_file() else None
