"""Build models/mstar_models/bagel/tokenizer_tiny.json: the small tokenizer BAGEL's Tokenizer node falls back to.

Why: the real Qwen2.5 tokenizer comes with the checkpoint, which tests and benchmarks with
random weights do not have (and nothing may be downloaded). This one has the *shape* of
Qwen2's `tokenizer.json`: Qwen2's pre-tokenizer regex, byte-level BPE (any text encodes,
nothing is unknown), no post-processor (Qwen2 adds no BOS; BAGEL's text segment adds
<|im_start|> and <|im_end|> itself). Its vocabulary fits the tiny variant's 300 ids: 256 bytes
+ 40 merges learned from the sentences below (ids 0..295), then BAGEL's four special tokens at
296..299 (`bos_id` .. `vision_end_id` of the walk's tiny variant). With random weights at real
size the same file gives well-formed prompts; the specials are then remapped to Qwen's ids
by the node (mstar_models/bagel/tokenizer.py).

Run from the repository root (deterministic: the same corpus gives the same file):
    python tools/make_bagel_tiny_tokenizer.py [--out PATH]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_tokenizer import byte_level_bpe, out_path  # noqa: E402 - the sibling module, found through the line above

OUT = Path(__file__).resolve().parent.parent / "models" / "mstar_models" / "bagel" / "tokenizer_tiny.json"
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
MERGES = 40
# Qwen2's pre-tokenizer split (its tokenizer.json, `pre_tokenizer.pretokenizers[0]`)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "A photo of a red fox sitting in the snow at the edge of a pine forest, soft morning light.",
    "What is in this image? Describe the colours, the objects and where they are.",
    "Make the sky purple and add a full moon above the mountains.",
    "The cat is sleeping on a blue sofa next to a window; there is a plant on the table.",
    "You should first think about the planning process in the mind and then generate the image.",
    "A watercolour painting of a small harbour with boats, houses and seagulls in the evening.",
]


def build() -> Tokenizer:
    tok = byte_level_bpe(QWEN2_SPLIT, CORPUS, 256 + MERGES)
    tok.add_special_tokens(SPECIALS)
    return tok


def main() -> None:
    out = out_path(__doc__, OUT)
    tok = build()
    ids = [tok.token_to_id(s) for s in SPECIALS]
    if ids != list(range(296, 300)):
        raise SystemExit(f"specials landed at {ids}, not 296..299: change MERGES")
    data = json.loads(tok.to_str())
    out.write_text(json.dumps(data, ensure_ascii=False, indent=None, sort_keys=True) + "\n")
    print(f"wrote {out}: {tok.get_vocab_size()} ids")


if __name__ == "__main__":
    main()
