"""The architecture catalogue: every node's weight tensors (official names + shapes) from config.

An `arch NAME(k=v, ...)` line in a `.walk` file names one function of `REGISTRY`; lowering
calls it with the evaluated keyword arguments and the node's weights dtype and gets an
`ArchSpec`: the exact tensor list of the released checkpoint (what the loader checks
safetensors headers against, what the memory pass sums), the dims tensor parallelism must
divide, and the KV geometry of kv nodes. Pure Python, no torch: the compiler computes
sizes for a 35B model without weights on disk.

One module per family: `llama` (Orpheus), `snac`, `vjepa2`, `bagel` + `flux_vae`,
`qwen3_omni`, `whisper`, `pi05`. Shared argument checking and tensor building live in `_common`.
"""

from __future__ import annotations

from mstarc.archs import bagel, flux_vae, llama, pi05, qwen3_omni, snac, vjepa2, whisper
from mstarc.archs.spec import (
    DTYPE_BYTES,
    SHARD_ROLES,
    WEIGHT_DTYPES,
    ArchError,
    ArchFn,
    ArchSpec,
    KVGeometry,
    TensorSpec,
)

__all__ = [
    "DTYPE_BYTES", "REGISTRY", "SHARD_ROLES", "WEIGHT_DTYPES", "ArchError", "ArchFn", "ArchSpec",
    "KVGeometry", "TensorSpec", "get_arch",
]


def _build_registry() -> dict[str, ArchFn]:
    registry: dict[str, ArchFn] = {}
    for family in (llama, snac, vjepa2, bagel, flux_vae, qwen3_omni, whisper, pi05):
        for name, fn in family.ARCHS.items():
            assert name not in registry, f"arch {name} is defined twice"
            registry[name] = fn
    return dict(sorted(registry.items()))


REGISTRY: dict[str, ArchFn] = _build_registry()


def get_arch(name: str) -> ArchFn:
    """The architecture function called `name`; KeyError listing the known names if none."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown architecture '{name}'; known: {', '.join(REGISTRY)}") from None
