"""Qwen3-Omni-30B-A3B (models/qwen3_omni/qwen3_omni.walk): the node classes its plan names `mstar_models.qwen3_omni.<Class>`.

- Processor (stateless): chat template, tokens, log-mel features, image patches; streamed text (processor.py)
- AudioEncoder (stateless): log-mel -> thinker-width audio tokens (audio_encoder.py)
- VisionEncoder (stateless): image patches -> merged tokens and deepstack maps (vision_encoder.py)
- ThinkerMoE (kv): the MoE text model; text decode, and the talker's inputs in the speech phases (thinker.py)
- TalkerMoE (kv): the MoE talker and its code predictor (code_predictor.py): one codec frame of 16
  codes per 80 ms step, one CUDA graph per batch on a GPU (talker.py)
- Code2Wav (stateless): codec frames -> 24 kHz audio with the keep-last streaming rule (code2wav.py)

Shared: positions.py (`rope_index`'s 3-D positions), tokens.py (special ids), lm_common.py
(input checks). The decoder stack, the MoE block, M-RoPE and the norms are the layer library's
(`mstar_models.layers`); moe.py keeps the MoE block's old import path.
"""

from mstar_models.qwen3_omni.audio_encoder import AudioEncoder
from mstar_models.qwen3_omni.code2wav import Code2Wav
from mstar_models.qwen3_omni.processor import Processor
from mstar_models.qwen3_omni.talker import TalkerMoE
from mstar_models.qwen3_omni.thinker import ThinkerMoE
from mstar_models.qwen3_omni.vision_encoder import VisionEncoder

__all__ = ["AudioEncoder", "Code2Wav", "Processor", "TalkerMoE", "ThinkerMoE", "VisionEncoder"]
