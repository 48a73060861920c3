"""Checkpoint names of V-JEPA 2-AC: the official `.pt` -> safetensors, and our names -> HF's.

The released `vjepa2-ac-vitg.pt` is a torch pickle holding `{"encoder": state_dict,
"predictor": state_dict, ...}` whose keys carry DDP/hub wrappers (`module.`, `backbone.`);
the official loader (`_clean_backbone_key`) strips them. After stripping, the encoder's names
(`patch_embed.*`, `blocks.*`, `norm.*`) and the predictor's (`predictor_*`, `*_encoder.*`) do
not collide, so one flat safetensors file holds both, each under exactly the name its node's
arch lists (`mstarc/archs/vjepa2.py`): no prefix, no rename. A stale encoder `pos_embed`
(the RoPE model has no such parameter; the official code loads with strict=False) is
dropped, because the runtime's loader refuses checkpoint tensors no node claims.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

WRAPPERS = ("module.", "backbone.")
DROPPED = ("pos_embed",)  # encoder leftovers with no parameter in the RoPE model
PARTS = ("encoder", "predictor")


def clean_key(key: str) -> str:
    """Strip the `module.` / `backbone.` wrappers (in any order, any number) from a key."""
    changed = True
    while changed:
        changed = False
        for w in WRAPPERS:
            if key.startswith(w):
                key, changed = key[len(w) :], True
    return key


def official_to_flat(checkpoint: Mapping[str, object], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The encoder and predictor state dicts of an official checkpoint as one flat name -> tensor map."""
    out: dict[str, torch.Tensor] = {}
    for part in PARTS:
        sd = checkpoint.get(part)
        if not isinstance(sd, Mapping):
            raise ValueError(f"checkpoint has no '{part}' state dict (keys: {', '.join(map(str, checkpoint))})")
        for key, value in sd.items():
            if not isinstance(value, torch.Tensor):
                continue
            name = clean_key(str(key))
            if part == "encoder" and name in DROPPED:
                continue
            if name in out:
                raise ValueError(f"'{name}' appears twice after stripping wrappers (from '{part}.{key}')")
            t = value.detach().contiguous()
            out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def convert(pt_path: Path, out_dir: Path, dtype: torch.dtype | None = None) -> Path:
    """Read the official `.pt` once (weights_only: no code runs) and write `model.safetensors`."""
    from safetensors.torch import save_file

    try:
        checkpoint = torch.load(pt_path, map_location="cpu", weights_only=True)
    except OSError:  # a missing or unreadable file: the tool says so as it is
        raise
    except Exception as e:  # noqa: BLE001 - not a checkpoint (or one weights_only refuses): the unpickler's error, any kind
        raise ValueError(f"'{pt_path}' is not a checkpoint torch.load reads with weights_only: "
                         f"{type(e).__name__}: {e}") from None
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f"'{pt_path}' holds a {type(checkpoint).__name__}, not a dict with 'encoder' and 'predictor'")
    tensors = official_to_flat(checkpoint, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "model.safetensors"
    save_file(tensors, str(target), metadata={"format": "pt", "source": pt_path.name})
    return target


def hf_encoder_state_dict(ours: Mapping[str, torch.Tensor], depth: int, dim: int) -> dict[str, torch.Tensor]:
    """Our encoder names -> `transformers.VJEPA2Model`'s (`encoder.*`), the fused qkv split into
    query/key/value (rows [0:d], [d:2d], [2d:3d], the official `qkv(x).unflatten(-1, (3, H, hd))` order)."""
    out = {
        "encoder.embeddings.patch_embeddings.proj.weight": ours["patch_embed.proj.weight"],
        "encoder.embeddings.patch_embeddings.proj.bias": ours["patch_embed.proj.bias"],
        "encoder.layernorm.weight": ours["norm.weight"],
        "encoder.layernorm.bias": ours["norm.bias"],
    }
    for i in range(depth):
        src, dst = f"blocks.{i}", f"encoder.layer.{i}"
        for n in ("norm1", "norm2", "mlp.fc1", "mlp.fc2"):
            for p in ("weight", "bias"):
                out[f"{dst}.{n}.{p}"] = ours[f"{src}.{n}.{p}"]
        for p in ("weight", "bias"):
            out[f"{dst}.attention.proj.{p}"] = ours[f"{src}.attn.proj.{p}"]
            q, k, v = ours[f"{src}.attn.qkv.{p}"].split(dim, dim=0)
            out[f"{dst}.attention.query.{p}"], out[f"{dst}.attention.key.{p}"] = q, k
            out[f"{dst}.attention.value.{p}"] = v
    return out
