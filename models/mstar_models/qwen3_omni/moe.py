"""Qwen3-Omni's sparse MoE block is the layer library's (`mstar_models.layers.moe`); this name keeps its old import path."""

from mstar_models.layers.moe import (
    SparseMoE,
    grouped_experts,
    grouped_mm_supported,
    loop_experts,
    padded_experts,
    route,
)

__all__ = ["SparseMoE", "grouped_experts", "grouped_mm_supported", "loop_experts", "padded_experts", "route"]
