"""A streaming speech recogniser in the shape of an encoder-decoder (models/asr/asr.walk):
the node classes its plan names `mstar_models.asr.<Class>`.

- Encoder (stateless): encode(samples) -> (states); one chunk of audio to encoder frames
- Decoder (kv, tags text and cross): listen(states) -> () appends the frames' cross-attention
  K/V to @cross; step() -> (token, done) writes one token to @text, attending to @text
  (self-attention) and to @cross (`reads decoder@cross`, cross-attention)
"""

from mstar_models.asr.nodes import Decoder, Encoder

__all__ = ["Decoder", "Encoder"]
