"""The pre-norm decoder stack of Llama, Qwen3 and their kin: attention and an MLP per layer, residuals, a final norm.

One layer is `x = norm(h); h += attn(x); x = norm(h); h += mlp(x)` (transformers'
`LlamaDecoderLayer`, `Qwen3DecoderLayer`, `Qwen3OmniMoeThinkerTextDecoderLayer`): the
attention is `attention.Attention` (QK-norm or not), the MLP whatever the caller builds per
layer (`mlp.GatedMLP`, `moe.SparseMoE`). The parameters carry the checkpoint's names under
the stack's prefix (`layers.{i}.self_attn.q_proj.weight`, `layers.{i}.mlp.*`,
`layers.{i}.input_layernorm.weight`, `norm.weight`).

`DecoderNode` is the base of a KV node built on the stack (`self.model`): the engine sizes the
node's KV pool from the stack's layers and this rank's KV heads.

FP8 weights (`Decoder.quantize_fp8_`, `DecoderNode.quantize_weights("fp8")`, which the loader
calls after filling the weights when the plan says so): every layer's q/k/v, o_proj,
gate/up and down_proj become E4M3 with per-output-channel scales (`layers.fp8`); the
embedding, the norms and the LM head stay in the checkpoint's dtype.

`forward_layers` is pure tensor code whose only attention is `attend`, so an engine may
capture it in a CUDA graph. Each residual add is fused with the norm after it
(`fused.add_rms_norm`: one kernel on a GPU; the last with the final norm). With
`unit_offset` (Gemma) every norm is `norm.gemma_rms_norm` (gain 1 + w) after a plain add.
`after_layer(i, h)` lets the caller read or change the residual stream after layer i
(Qwen3-Omni's deepstack additions and its hidden-state tap for the talker); then that add
and the next norm run apart.

Tensor parallelism lives in the layers: built with this rank's heads, KV heads and MLP width,
the row-parallel outputs are all-reduced there, so every rank carries the same full residual
stream and `after_layer` sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mstar_models.layers.attention import Attend, Attention
from mstar_models.layers.norm import RMSNorm
from mstar_runtime.ops import fused, node

AfterLayer = Callable[[int, torch.Tensor], torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, attention: Attention, mlp: nn.Module, hidden: int, eps: float, *, unit_offset: bool = False,
                 **factory: Any):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=unit_offset, **factory)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=unit_offset, **factory)


class Decoder(nn.Module):
    """`layers.{i}.*` and `norm.weight`; `mlp(i)` builds layer i's MLP. `heads` and `kv_heads`
    are this rank's; `group` (None at tp 1) sums the row-parallel outputs over the TP group.
    `embed`, when given, is registered first as `embed_tokens` (Llama's parameter order, which
    a seeded init follows). `unit_offset`: Gemma's `1 + w` norms."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 mlp: Callable[[int], nn.Module], *, qk_norm: bool = False, group: Any = None,
                 embed: nn.Module | None = None, unit_offset: bool = False, **factory: Any):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        if embed is not None:
            self.embed_tokens = embed
        self.layers = nn.ModuleList(
            DecoderLayer(Attention(hidden, heads, kv_heads, head_dim, eps=eps, qk_norm=qk_norm, group=group,
                                   **factory), mlp(i), hidden, eps, unit_offset=unit_offset, **factory)
            for i in range(layers)
        )
        self.norm = RMSNorm(hidden, eps, unit_offset=unit_offset, **factory)

    @property
    def kv_geometry(self) -> node.KVGeometry:
        """This rank's K/V layout (one entry per token and layer, this rank's KV heads): what
        the node's `kv_geometry` gives the engine to size its pool."""
        attn = self.layers[0].self_attn
        return node.KVGeometry(len(self.layers), attn.kv_heads, attn.head_dim)

    def quantize_fp8_(self) -> None:
        """Every layer's attention and MLP projections to FP8 (`FusedRows.quantize_fp8_`); a
        layer whose MLP has no FP8 form (a sparse MoE) is refused before any is changed."""
        for i, layer in enumerate(self.layers):
            if not callable(getattr(layer.mlp, "quantize_fp8_", None)):
                raise TypeError(f"layer {i}'s MLP ({type(layer.mlp).__name__}) has no FP8 form")
        for layer in self.layers:
            layer.self_attn.quantize_fp8_()
            layer.mlp.quantize_fp8_()

    def forward_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                       after_layer: AfterLayer | None = None) -> torch.Tensor:
        """Packed rows h [N, hidden] with their RoPE tables [N, 1, head_dim] -> final-normed [N, hidden]."""
        eps, layers = self.eps, self.layers
        if self.unit_offset:
            return self._forward_unit_offset(h, cos, sin, attend, after_layer)
        x = fused.rms_norm(h, layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(layers):
            o = layer.self_attn(i, x, cos, sin, attend)
            h, x = fused.add_rms_norm(h, o, layer.post_attention_layernorm.weight, eps)
            m = layer.mlp(x)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            if after_layer is None:
                h, x = fused.add_rms_norm(h, m, norm.weight, eps)
            else:
                h = after_layer(i, h + m)
                x = fused.rms_norm(h, norm.weight, eps)
        return x

    def _forward_unit_offset(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                             after_layer: AfterLayer | None) -> torch.Tensor:
        """`forward_layers` with Gemma's norms (transformers' GemmaDecoderLayer: add, then norm)."""
        for i, layer in enumerate(self.layers):
            h = h + layer.self_attn(i, layer.input_layernorm(h), cos, sin, attend)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if after_layer is not None:
                h = after_layer(i, h)
        return self.norm(h)


class DecoderNode(node.KVNode):
    """A KV node whose paged K/V are written by the `Decoder` at `self.model`: its
    `kv_geometry` is that stack's (this rank's KV heads), which sizes the node's pool."""

    model: Decoder

    @property
    def kv_geometry(self) -> node.KVGeometry:
        return self.model.kv_geometry

    def quantize_weights(self, fmt: str) -> None:
        """The loader's load-time transform for the plan's `quantized` format: "fp8" quantizes
        the decoder stack's projections (`Decoder.quantize_fp8_`)."""
        if fmt != "fp8":
            raise ValueError(f"node '{self.spec.name}': no weights format '{fmt}' (known: fp8)")
        self.model.quantize_fp8_()
