"""π0.5 (Physical Intelligence's pi05, as LeRobot's `policies/pi05` runs it): the node classes
models/pi05/pi05.walk names `mstar_models.pi05.<Class>`.

- Prompt (stateless): build(instruction, state) -> (tokens); the state discretised into text
- SiglipTower (stateless): encode(images) -> (tokens); PaliGemma's SigLIP and projector
- GemmaVLM (kv): prefill(images, prompt) -> (); the prefix K/V the expert reads
- ActionExpert (kv): denoise(x, t) -> (v); adaptive-norm Gemma-300M reading the VLM's context
- Flow (stateless): init / start / time / step / finish; the Euler flow-matching sampler
"""

from mstar_models.pi05.nodes import ActionExpert, Flow, GemmaVLM
from mstar_models.pi05.prompt import Prompt
from mstar_models.pi05.vision import SiglipTower

__all__ = ["ActionExpert", "Flow", "GemmaVLM", "Prompt", "SiglipTower"]
