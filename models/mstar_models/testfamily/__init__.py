"""The runtime's test model family (`models/testfamily/testfamily.walk`).

Node classes (the plan names them `mstar_models.testfamily.<Class>`):
  TinyPrompt (stateless)  encode(text) -> tokens                  byte-level, no weights
  TinyLM     (kv)         prefill / decode / denoise              tiny Llama + flow glue
  TinyCodec  (stateless)  decode_window / decode_block / decode_frames  codes -> samples
  TinyFlow   (stateless)  init / time / step                      flow-matching arithmetic

Stream chunks reach TinyCodec as `entry[port]` (the items) plus `entry[port + ":context"]`
(how many leading items are context); see `common.CONTEXT_SUFFIX`.
`reference.py` runs every walk densely on the same modules, without the runtime.
"""

from mstar_models.testfamily.codec import TinyCodec
from mstar_models.testfamily.common import CONTEXT_SUFFIX
from mstar_models.testfamily.echo import EchoLM
from mstar_models.testfamily.flow import TinyFlow
from mstar_models.testfamily.lm import TinyLM
from mstar_models.testfamily.prompt import TinyPrompt

__all__ = ["CONTEXT_SUFFIX", "EchoLM", "TinyCodec", "TinyFlow", "TinyLM", "TinyPrompt"]
