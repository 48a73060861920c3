"""V-JEPA 2-AC (facebookresearch/vjepa2): the ViT video encoder, the action-conditioned predictor
(a KV node: a rollout step runs one block per trajectory over the cached context) and the
CEM planner. Walks and configs: vjepa2.walk; facts: docs/models/vjepa2.md.
"""

from mstar_models.vjepa2.cem import CemPlanner
from mstar_models.vjepa2.encoder import VitEncoder
from mstar_models.vjepa2.predictor import ACPredictor

__all__ = ["ACPredictor", "CemPlanner", "VitEncoder"]
