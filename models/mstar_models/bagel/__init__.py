"""BAGEL-7B-MoT (models/bagel/bagel.walk): the node classes its plan names `mstar_models.bagel.<Class>`.

- Tokenizer (stateless): text segments, think system prompts, streamed text (tokenizer.py)
- SiglipNaViT (stateless): image -> LLM-width tokens; SigLIP NaViT + connector + positions (vit.py)
- MoTLanguageModel (kv): the Mixture-of-Transformers LLM with its generation glue: text, ViT and
  VAE prefills, text decode (also as a decode cohort), denoise (mot.py)
- FluxVaeEncoder / FluxVaeDecoder (stateless): the FLUX VAE with (un)patchify (vae.py)
- FlowStep (stateless): noise, schedule, CFG guidance and the Euler step (flow.py)

Shared: transforms.py (the official ImageTransform resize), reference.py (a dense, unbatched
re-derivation of the official forward, used by the tests).
"""

from mstar_models.bagel.flow import FlowStep
from mstar_models.bagel.mot import MoTLanguageModel
from mstar_models.bagel.tokenizer import Tokenizer
from mstar_models.bagel.vae import FluxVaeDecoder, FluxVaeEncoder
from mstar_models.bagel.vit import SiglipNaViT

__all__ = ["FlowStep", "FluxVaeDecoder", "FluxVaeEncoder", "MoTLanguageModel", "SiglipNaViT", "Tokenizer"]
