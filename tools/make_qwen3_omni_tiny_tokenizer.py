"""Build models/mstar_models/qwen3_omni/tokenizer_tiny.json: the small tokenizer Qwen3-Omni's Processor falls back to.

Why: the real Qwen tokenizer comes with the checkpoint, which tests and benchmarks with random
weights do not have (and nothing may be downloaded), and the tiny variant's vocabulary has 512
ids. This file has the *shape* of Qwen's tokenizer: NFC normalisation, Qwen2's pre-tokenizer
regex, byte-level BPE (any text encodes, nothing is unknown), no BOS. Its vocabulary:
- ids 0..478: 256 bytes + 223 merges learned from the chat-like paragraphs below, in which the
  role words `system`, `user` and `assistant` are single tokens, as in Qwen's vocabulary
  (8948, 872, 77091);
- ids 479..511: Qwen's 33 added tokens 151643..151675 (`<|endoftext|>` .. `<|audio_pad|>`) in
  their order, so tiny id = real id - 151164. Which are `special` (skipped when decoding)
  follows Qwen3's tokenizer_config: all but the tool, FIM and think tokens.
mstar_models.qwen3_omni.processor relabels these ids to the real ones when a model's vocabulary
is real-sized (benchmarks with dummy weights), so both sizes agree with `token_ids(vocab)`.

Run from the repository root (deterministic: the same corpus gives the same file):
    python tools/make_qwen3_omni_tiny_tokenizer.py [--out PATH]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, normalizers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_tokenizer import byte_level_bpe, out_path  # noqa: E402 - the sibling module, found through the line above

OUT = Path(__file__).resolve().parent.parent / "models" / "mstar_models" / "qwen3_omni" / "tokenizer_tiny.json"
TEXT_TOKENS = 479  # 256 bytes + 223 merges; ids 479..511 are the added tokens
FIRST_ADDED = 151643  # Qwen's <|endoftext|>
# Qwen's added tokens 151643..151675, in id order
ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
]
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
ROLES = ("system", "user", "assistant")
# transformers' Qwen2Tokenizer PRETOKENIZE_REGEX
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = [
    "system\nYou are a helpful assistant that can hear, see and speak. Answer the user briefly and kindly.",
    "user\nWhat is in this picture? Please describe the colours, the people and the place.",
    "assistant\nThe picture shows a small harbour at sunset: boats, a red lighthouse and two people walking.",
    "user\nWhat did the speaker say in the audio, and how did she sound?",
    "assistant\nShe said that the train leaves at seven, and she sounded calm and a little tired.",
    "system\nYou are Qwen, a virtual human developed by the Qwen Team, capable of perceiving auditory and "
    "visual inputs, as well as generating text and speech.",
    "user\nTell me a short story about a cat who lives in a library and reads at night.",
    "assistant\nOnce upon a time, in a quiet library, there lived a cat who loved the smell of old books.",
    "user\nHow many seconds of speech are in one minute? Count the words too, please.",
    "assistant\nThere are sixty seconds in one minute; at a normal pace that is about one hundred and fifty words.",
    "user\nCan you translate this sentence into French and German for me?",
    "assistant\nOf course. In French it is: bonjour, comment allez-vous? In German: guten Tag, wie geht es Ihnen?",
    "system\nThe user is a student. The assistant explains things step by step and checks the answer.",
    "user\nExplain why the sky is blue, in two or three sentences.",
    "assistant\nSunlight is scattered by the air, and blue light is scattered the most, so the sky looks blue.",
]


def build() -> Tokenizer:
    # the role words repeated so that BPE learns each as one token
    tok = byte_level_bpe(QWEN2_SPLIT, CORPUS * 2 + [" ".join(ROLES)] * 40, TEXT_TOKENS, min_frequency=2,
                         normalizer=normalizers.NFC())
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    if len(vocab) != TEXT_TOKENS:
        raise SystemExit(f"the corpus gave {len(vocab)} text tokens; need {TEXT_TOKENS} (write more text)")
    spec["added_tokens"] = [
        {"id": TEXT_TOKENS + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": t not in NOT_SPECIAL}
        for i, t in enumerate(ADDED)
    ]
    # also in the model's vocabulary: `tokenizers` keeps an added token's id only when the model
    # knows it, which is what lets the processor relabel them to Qwen's real ids
    vocab.update({t: TEXT_TOKENS + i for i, t in enumerate(ADDED)})
    out = Tokenizer.from_str(json.dumps(spec))
    for role in ROLES:
        if len(out.encode(role).ids) != 1:
            raise SystemExit(f"'{role}' is not a single token; add text that uses it")
    return out


def main(argv: list[str] | None = None) -> int:
    out = out_path(__doc__, OUT, argv)
    tok = build()
    out.write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    roles = {r: tok.token_to_id(r) for r in ROLES}
    print(f"wrote {out}: {tok.get_vocab_size()} tokens (text ids 0..{TEXT_TOKENS - 1}, "
          f"added {TEXT_TOKENS}..{TEXT_TOKENS + len(ADDED) - 1}); roles {roles}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
