"""Orpheus-3B TTS (models/orpheus/orpheus.walk): the node classes its plan names `mstar_models.orpheus.<Class>`.

- PromptBuilder (stateless): build(text, voice) -> tokens; the chat template (prompt.py)
- LlamaBackbone (kv): prefill / decode -> (token, code, done); Llama-3.2, sampling, token -> code (backbone.py)
- SnacDecoder (stateless): decode(codes) -> pcm; SNAC 24 kHz on 28-code windows (snac_decoder.py)
"""

from mstar_models.orpheus.backbone import LlamaBackbone
from mstar_models.orpheus.prompt import PromptBuilder
from mstar_models.orpheus.snac_decoder import SnacDecoder

__all__ = ["LlamaBackbone", "PromptBuilder", "SnacDecoder"]
