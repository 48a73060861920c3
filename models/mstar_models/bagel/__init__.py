"""BAGEL-7B-MoT (models/bagel/bagel.walk): the node classes its plan names `mstar_models.bagel.<Class>`.

- Tokenizer (stateless): text segments, think system prompts, streamed text (tokenizer.py)
- FlowStep (stateless): noise, schedule, CFG guidance and the Euler step (flow.py)
"""

from mstar_models.bagel.flow import FlowStep
from mstar_models.bagel.tokenizer import Tokenizer

__all__ = ["FlowStep", "Tokenizer"]
