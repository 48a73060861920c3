"""Build models/mstar_models/orpheus/tokenizer_tiny.json: the small tokenizer Orpheus' PromptBuilder falls back to.

Why: the real Llama-3 tokenizer comes with the checkpoint, which tests and benchmarks with
random weights do not have (and nothing may be downloaded). This one has the same
*shape* as Llama 3's `tokenizer.json`: Llama 3's pre-tokenizer regex, byte-level BPE (so
any text encodes, nothing is unknown), and a post-processor that puts `<|begin_of_text|>`
first. Its vocabulary is tiny (256 bytes + 256 merges learned from the paragraphs below),
so its text ids are 0..511, valid Llama text ids, and the one special token is remapped
from the trainer's id to Llama's 128000. The prompt ids it gives are not those of the real
tokenizer; the prompt layout around them is.

Run from the repository root (deterministic: the same corpus gives the same file):
    python tools/make_orpheus_tiny_tokenizer.py [--out PATH]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_tokenizer import byte_level_bpe, out_path  # noqa: E402 - the sibling module, found through the line above

OUT = Path(__file__).resolve().parent.parent / "models" / "mstar_models" / "orpheus" / "tokenizer_tiny.json"
BOS, BOS_ID = "<|begin_of_text|>", 128000
MERGES = 256  # on top of the 256 byte tokens: a 512-entry text vocabulary
# Llama 3's pre-tokenizer split (its tokenizer.json, `pre_tokenizer.pretokenizers[0]`)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = [
    "tara: Hey there, my name is Tara, and I'm a speech generation model that can sound like a person. "
    "I can laugh <laugh> and sigh <sigh> when the moment calls for it, and I try to keep the rhythm "
    "of natural conversation, with the pauses and the little hesitations that people make.",
    "leo: The weather today will be mostly sunny in the morning, with clouds moving in from the west "
    "during the afternoon. Temperatures will reach twenty two degrees, and there is a small chance "
    "of rain in the evening, so you might want to take an umbrella with you when you go out.",
    "mia: Once upon a time, in a little house at the edge of the forest, there lived an old woman "
    "and her cat. Every morning the woman would open the window, and the cat would sit on the sill "
    "and watch the birds, while the kettle sang on the stove and the bread was baking in the oven.",
    "dan: Thank you for calling. Your call is important to us. Please hold the line and one of our "
    "agents will be with you shortly. If you know the extension of the person you are trying to "
    "reach, you can dial it at any time. For opening hours and directions, please press one.",
    "zoe: I honestly did not expect that! When she opened the door and saw everyone standing there, "
    "she just froze for a second, and then she started laughing so hard that she had to sit down. "
    "It was the best surprise party any of us had ever been to, and we talked about it for weeks.",
    "jess: To make a good cup of tea, first boil fresh water, then warm the pot. Add one spoon of "
    "tea for each person and one for the pot. Pour the water, wait three to five minutes, and then "
    "pour it into the cups. Some people add milk first, others add it last; both are fine by me.",
    "zac: The train to the city leaves at seven fifteen from platform four. It stops at every "
    "station on the way, and the whole journey takes about forty minutes. Tickets can be bought "
    "at the machines in the hall, on the train from the conductor, or on your phone before you go.",
    "leah: Speech is made of sounds, and sounds are made of waves: the air moves back and forth "
    "many thousands of times a second. A model that speaks has to learn when to be loud and when to "
    "be quiet, where to breathe, and how the pitch of a voice rises at the end of a question?",
    "tara: Good morning, everyone, and welcome back to the show. Today we are talking about gardens: "
    "what to plant in spring, how often to water, and why the tomatoes always seem to ripen all at "
    "once. Our first guest has been growing vegetables for more than thirty years, so listen closely.",
    "leo: The library opens at nine o'clock on weekdays and at ten on Saturdays. Members can borrow "
    "up to twelve books, four films and two games at a time, for three weeks each. Returned items "
    "go in the box by the entrance, and the reading room upstairs is quiet, so please whisper there.",
    "mia: Remember to bring your passport, your boarding pass and a jacket, because the plane can be "
    "cold at night. We land at half past six in the morning, local time, and a driver will be waiting "
    "outside the arrivals hall with a sign that has our family name written on it in big letters.",
    "dan: Breaking news this evening: the city council has approved the plan for a new bridge across "
    "the river. Construction should begin next year and will take about three years to complete. "
    "Until then, the ferry will keep running every twenty minutes between the old harbour and the park.",
]


def build() -> Tokenizer:
    tok = byte_level_bpe(LLAMA3_SPLIT, CORPUS, 256 + MERGES, min_frequency=2)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    if len(vocab) != 256 + MERGES or max(vocab.values()) >= BOS_ID:
        raise SystemExit(f"the corpus gave {len(vocab)} text tokens; need {256 + MERGES} (write more text)")
    # `tokenizers` renumbers added tokens to follow the vocabulary, so BOS goes into the model's
    # vocabulary at Llama's id and is declared special there.
    vocab[BOS] = BOS_ID
    spec["added_tokens"] = [
        {
            "id": BOS_ID,
            "content": BOS,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    ]
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": BOS, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": BOS, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {BOS: {"id": BOS, "ids": [BOS_ID], "tokens": [BOS]}},
    }
    return Tokenizer.from_str(json.dumps(spec))


def main(argv: list[str] | None = None) -> int:
    out = out_path(__doc__, OUT, argv)
    tok = build()
    out.write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    print(
        f"wrote {out}: {tok.get_vocab_size()} tokens (text ids 0..{256 + MERGES - 1}, {BOS} = {BOS_ID})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
