"""V-JEPA 2 (facebookresearch/vjepa2): the ViT video encoder and the action-conditioned predictor.

Owns `vjepa2_vit` (`blocks.{i}...`, the encoder of vjepa2-ac-vitg.pt after the loader strips
its `module.`/`backbone.` prefixes) and `vjepa2_ac_predictor` (`predictor_blocks.{i}...`).
Both use 3-D RoPE, so there is no position-embedding tensor (the encoder may carry a stale
`pos_embed`, which the official code loads with strict=False and ignores; so do we).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstarc.archs._common import BOOL, INT, Tensors, parse_args, require
from mstarc.archs.spec import ArchSpec, KVGeometry

VIT_ARGS = {
    "dim": INT(),
    "depth": INT(),
    "heads": INT(),
    "mlp": INT(),  # int(dim * mlp_ratio): 6144 for ViT-g's 48/11
    "patch": INT(),
    "tubelet": INT(),
    "in_chans": INT(3),
    "qkv_bias": BOOL(True),
}

PREDICTOR_ARGS = {
    "enc_dim": INT(),
    "dim": INT(),
    "depth": INT(),
    "heads": INT(),
    "mlp": INT(),
    "action_dim": INT(7),
    "state_dim": INT(7),
    # the checkpoint has extrinsics_encoder even though use_extrinsics=False
    "extrinsics_dim": INT(6),
}


def _block(t: Tensors, p: str, dim: int, mlp: int, qkv_bias: bool) -> None:
    """timm-style pre-norm block: LayerNorms with bias, fused qkv, GELU MLP."""
    t.norm(f"{p}.norm1", dim, bias=True)
    # fused [q; k; v]: a "col" split takes the same head range from each third
    t.linear(f"{p}.attn.qkv", 3 * dim, dim, qkv_bias, "col")
    t.linear(f"{p}.attn.proj", dim, dim, True, "row")
    t.norm(f"{p}.norm2", dim, bias=True)
    t.linear(f"{p}.mlp.fc1", mlp, dim, True, "col")
    t.linear(f"{p}.mlp.fc2", dim, mlp, True, "row")


def _heads(dim: int, heads: int, arg: str) -> int:
    require(dim % heads == 0, f"{arg} ({dim}) must be divisible by heads ({heads})", "heads")
    head_dim = dim // heads
    # 3-D RoPE splits each head into d/h/w parts of 2*((head_dim//3)//2) dims each
    require(head_dim >= 6, f"head_dim {head_dim} is too small for 3-D RoPE (needs >= 6)", "heads")
    return head_dim


def vjepa2_vit(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = parse_args("vjepa2_vit", args, VIT_ARGS)
    head_dim = _heads(a["dim"], a["heads"], "dim")
    t = Tensors(dtype)
    d = a["dim"]
    t.conv("patch_embed.proj", d, a["in_chans"], (a["tubelet"], a["patch"], a["patch"]))  # Conv3d
    for i in range(a["depth"]):
        _block(t, f"blocks.{i}", d, a["mlp"], a["qkv_bias"])
    t.norm("norm", d, bias=True)
    dims = {"layers": a["depth"], "hidden": d, "heads": a["heads"], "head_dim": head_dim,
            "intermediate": a["mlp"]}
    return t.spec(dims, None)


def vjepa2_ac_predictor(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = parse_args("vjepa2_ac_predictor", args, PREDICTOR_ARGS)
    head_dim = _heads(a["dim"], a["heads"], "dim")
    t = Tensors(dtype)
    d = a["dim"]
    t.linear("predictor_embed", d, a["enc_dim"])
    t.linear("action_encoder", d, a["action_dim"])
    t.linear("state_encoder", d, a["state_dim"])
    t.linear("extrinsics_encoder", d, a["extrinsics_dim"])
    for i in range(a["depth"]):
        _block(t, f"predictor_blocks.{i}", d, a["mlp"], True)
    t.norm("predictor_norm", d, bias=True)
    t.linear("predictor_proj", a["enc_dim"], d)
    dims = {"layers": a["depth"], "hidden": d, "heads": a["heads"], "kv_heads": a["heads"],
            "head_dim": head_dim, "intermediate": a["mlp"]}
    # plain multi-head attention: every head has its own K/V
    return t.spec(dims, KVGeometry(a["depth"], a["heads"], head_dim))


ARCHS = {"vjepa2_vit": vjepa2_vit, "vjepa2_ac_predictor": vjepa2_ac_predictor}
