"""Qwen3-Omni's special token ids and constants, read from a node's config with the released values as defaults.

The defaults are the released `config.json` values (docs/models/qwen3_omni.md, Facts) when the thinker
vocabulary holds them, else the ids of the bundled 512-id tiny tokenizer (Qwen's added tokens
moved down to 479..511, the role words at their tiny ids): the same table as
`processor.token_ids(vocab)`, kept here so the language-model nodes need not import the
processor's tokenizer stack (tests/test_qwen3_omni_lm.py checks that the two agree). A config
value of the same name (`audio_token_id`, ...) overrides a default: `TokenIds.from_spec` takes
the node's `arch` arguments first, then the model config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mstar_runtime.ops import node

SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
# the bundled tiny tokenizer (processor.TINY_IDS): Qwen's added tokens 151643.. at 479.., its role words
TINY_OFFSET = 151643 - 479
TINY_ROLES = {"system_token_id": 273, "user_token_id": 265, "assistant_token_id": 298}


@dataclass(frozen=True)
class TokenIds:
    # thinker vocabulary (released values)
    audio_token_id: int = 151675
    image_token_id: int = 151655
    video_token_id: int = 151656
    audio_start_token_id: int = 151669
    audio_end_token_id: int = 151670
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    system_token_id: int = 8948
    user_token_id: int = 872
    assistant_token_id: int = 77091
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673
    # 3-D positions: temporal units per second of video / audio; the vision encoder's 2x2 merge
    position_id_per_seconds: float = 13
    vis_merge: int = 2
    # talker codec vocabulary
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    codec_eos_token_id: int = 2150
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    speakers: Mapping[str, int] = field(default_factory=lambda: dict(SPEAKERS))

    @property
    def multimodal(self) -> tuple[int, int, int]:
        """The placeholder ids whose positions carry encoder outputs (audio, image, video)."""
        return (self.audio_token_id, self.image_token_id, self.video_token_id)

    @classmethod
    def tiny(cls) -> TokenIds:
        """The ids of the bundled 512-id tokenizer (the walk's tiny variant)."""
        real = cls()
        moved = {f.name: getattr(real, f.name) - TINY_OFFSET for f in dataclasses.fields(cls)
                 if f.name.endswith("token_id") and getattr(real, f.name) > TINY_OFFSET}
        return dataclasses.replace(real, **moved, **TINY_ROLES)

    @classmethod
    def from_spec(cls, spec: node.NodeSpec) -> TokenIds:
        """The node's ids: the defaults for its model's thinker vocabulary (config `vocab`), then
        the config's own values."""
        vocab = spec.config.get("vocab", spec.arch_args.get("vocab", 152064))
        base = cls() if int(vocab) > cls().audio_token_id else cls.tiny()
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            for source in (spec.arch_args, spec.config):
                if f.name in source:
                    values[f.name] = source[f.name]
                    break
        speakers = values.get("speakers")
        if speakers is not None and not isinstance(speakers, Mapping):
            raise node.NodeError(f"node '{spec.name}': config 'speakers' must map names to codec ids, got {speakers!r}")
        try:
            return dataclasses.replace(base, **values)
        except TypeError as e:
            raise node.NodeError(f"node '{spec.name}': bad token-id config: {e}") from None
