"""A vision-language-action model in the shape of pi0 (models/vla/vla.walk): the node
classes its plan names `mstar_models.vla.<Class>`.

- Backbone (kv): prefill(prompt) -> (); a Llama-layout VLM whose context the expert reads
- ActionExpert (kv): denoise(x, t) -> (v); its own weights, attends to the VLM's prefix
  (`reads vlm`) and to its action tokens in one softmax, layer by layer
- Flow (stateless): init / time / step; the flow-matching sampler's arithmetic

The image tokens of a real VLA are left out: the prompt is token ids (an image encoder
would be one more node before `prefill`, as in BAGEL's walks).
"""

from mstar_models.vla.nodes import ActionExpert, Backbone, Flow

__all__ = ["ActionExpert", "Backbone", "Flow"]
