"""Qwen3-Omni's vision encoder as a stateless node: `encode(pixels, grid) -> (embeds, deepstack)`.

Our implementation of transformers 5.24's `Qwen3OmniMoeVisionEncoder.forward` (docs/models/qwen3_omni.md, Facts):
1. Patches [P, 3 * 2 * 16 * 16] (channel, time, row, column; in 2x2 merge-block order, as
   the image processor writes them) -> `patch_embed` (a Conv3d whose kernel equals its
   stride, i.e. one matmul per patch).
2. Plus the learned 48 x 48 position table resampled to each image's (h, w) patch grid:
   bilinear with align_corners, border-clamped, 4 taps per patch.
3. Blocks (LayerNorm eps 1e-6, fused qkv, 2-D RoPE, tanh-GELU MLP) whose attention is
   block-diagonal per frame (each image of t = 1 is one segment). RoPE: head_dim / 2 slots
   of rotation, the first half from the patch's row, the second from its column, each over
   head_dim / 4 frequencies of theta 10000; q and k rotate in fp32.
4. After the blocks listed in `deepstack`, a merger of that tap (2x2 patches -> one token,
   post-shuffle LayerNorm over 4 * hidden, Linear, GELU, Linear to the thinker width) gives
   one feature map; the thinker adds tap j to the output of its layer j at the image tokens.
5. The final merger (LayerNorm per patch before the shuffle) gives the image tokens.

Batching: every image of every request is one segment of one forward; attention never
crosses segments, so a request's output does not depend on its batch.

Names are the checkpoint's under `thinker.visual.` (the `qwen3_omni_vision` arch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.qwen3_omni.audio_encoder import Segments
from mstar_runtime.ops import node
from mstar_runtime.ops.ports import arch_values

ROPE_THETA = 10000.0  # the vision config's default rope_parameters (axial)
LN_EPS = 1e-6


class PatchEmbed(nn.Module):
    def __init__(self, cin: int, hidden: int, temporal: int, patch: int):
        super().__init__()
        k = (temporal, patch, patch)
        self.proj = nn.Conv3d(cin, hidden, kernel_size=k, stride=k)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(segments.pack(q), segments.pack(k), segments.pack(v),
                                           attn_mask=segments.key_mask)
        return self.proj(segments.unpack(o).reshape(n, -1))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, hd]; cos / sin [N, hd] fp32. Rotates in fp32, returns x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, intermediate)
        self.linear_fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, eps=LN_EPS)
        self.norm2 = nn.LayerNorm(hidden, eps=LN_EPS)
        self.attn = VisionAttention(hidden, heads)
        self.mlp = VisionMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge^2 consecutive patches -> one token at `out_dim`; `postshuffle` norms after the merge."""

    def __init__(self, hidden: int, merge: int, out_dim: int, postshuffle: bool):
        super().__init__()
        self.merged = hidden * merge * merge
        self.postshuffle = postshuffle
        self.ln_q = nn.LayerNorm(self.merged if postshuffle else hidden, eps=LN_EPS)
        self.mlp = nn.ModuleList([nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, out_dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_q(x.reshape(-1, self.merged)) if self.postshuffle else self.ln_q(x).reshape(-1, self.merged)
        for layer in self.mlp:
            h = layer(h)
        return h


class VisionEncoder(node.StatelessNode):
    """encode(pixels: f32[P, patch_dim], grid: i32[K, 3]) -> (embeds [Nv, out], deepstack [D, Nv, out])."""

    checkpoint_prefix: ClassVar[str] = "thinker.visual."

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        a = _args(spec)
        h, self.heads, self.merge = a["hidden"], a["heads"], a["merge"]
        self.patch, self.temporal = a["patch"], a["temporal_patch"]
        self.in_channels = a["in_channels"]
        self.patch_dim = self.in_channels * self.temporal * self.patch * self.patch
        self.out_dim = a["out_dim"]
        self.deepstack = [int(i) for i in a["deepstack"]]
        head_dim = h // self.heads
        if h % self.heads or head_dim % 4:
            raise node.NodeError(f"node '{spec.name}': hidden {h} / heads {self.heads} must be a multiple of 4 "
                                 "(2-D RoPE splits head_dim in four)")
        if any(not 0 <= i < a["depth"] for i in self.deepstack):
            raise node.NodeError(f"node '{spec.name}': deepstack taps {self.deepstack} must be blocks of "
                                 f"0..{a['depth'] - 1}")
        self.side = round(a["positions"] ** 0.5)
        if self.side * self.side != a["positions"]:
            raise node.NodeError(f"node '{spec.name}': positions {a['positions']} is not a square grid")
        self.patch_embed = PatchEmbed(self.in_channels, h, self.temporal, self.patch)
        self.pos_embed = nn.Embedding(a["positions"], h)
        self.blocks = nn.ModuleList(VisionBlock(h, self.heads, a["intermediate"]) for _ in range(a["depth"]))
        self.merger = PatchMerger(h, self.merge, self.out_dim, postshuffle=False)
        self.merger_list = nn.ModuleList(
            PatchMerger(h, self.merge, self.out_dim, postshuffle=True) for _ in self.deepstack
        )
        theta = float(spec.settings.get("rope_theta", spec.config.get("vis_rope_theta", ROPE_THETA)))
        spatial = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.to(device=spec.device, dtype=spec.dtype)

    @property
    def device(self) -> torch.device:
        return self.pos_embed.weight.device

    # ---- positions
    def _rows_cols(self, grid: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      torch.Tensor]:
        """Per patch, in merge-block order: row, column, and its frame's grid height and width."""
        rows, cols, hs, ws = [], [], [], []
        m = self.merge
        for t, h, w in grid:
            r = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            c = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            # block-major: (block row, block column, row in block, column in block)
            rows.append(r.permute(0, 2, 1, 3).reshape(-1).repeat(t))
            cols.append(c.permute(0, 2, 1, 3).reshape(-1).repeat(t))
            hs.append(torch.full((t * h * w,), h))
            ws.append(torch.full((t * h * w,), w))
        return tuple(torch.cat(x).to(self.device) for x in (rows, cols, hs, ws))  # type: ignore[return-value]

    def _axis_taps(self, index: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bilinear (align_corners) taps into the table's side and their weights: [N, 2] each."""
        src = index.float() * (self.side - 1) / torch.clamp(size - 1, min=1).float()
        lo = torch.floor(src)
        taps = lo.long()[:, None] + torch.arange(2, device=index.device)
        weights = (1 - (src[:, None] - taps.float()).abs()).clamp(min=0)
        return taps.clamp(0, self.side - 1), weights

    def position_embeddings(self, rows: torch.Tensor, cols: torch.Tensor, hs: torch.Tensor,
                            ws: torch.Tensor) -> torch.Tensor:
        """The position table resampled to each patch's grid: [N, hidden] in fp32."""
        ht, hw = self._axis_taps(rows, hs)
        wt, ww = self._axis_taps(cols, ws)
        idx = (ht[:, :, None] * self.side + wt[:, None, :]).reshape(-1, 4)
        wgt = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(idx) * wgt[:, :, None]).sum(1)

    def rope_tables(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.cat([rows.float()[:, None] * self.inv_freq, cols.float()[:, None] * self.inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    # ---- tensors
    def encode(self, pixels: torch.Tensor, grid: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """All patches [P, patch_dim] of the images `grid` lists -> (tokens [P / merge^2, out],
        deepstack [D, P / merge^2, out]) in the weights' dtype."""
        rows, cols, hs, ws = self._rows_cols(grid)
        x = self.patch_embed(pixels.to(self.device))
        x = x + self.position_embeddings(rows, cols, hs, ws).to(x.dtype)
        cos, sin = self.rope_tables(rows, cols)
        segments = Segments.of([h * w for t, h, w in grid for _ in range(t)], self.device)
        taps = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, segments)
            if i in self.deepstack:
                taps.append(self.merger_list[self.deepstack.index(i)](x))
        deep = torch.stack(taps) if taps else x.new_zeros(0, x.shape[0] // self.merge**2, self.out_dim)
        return self.merger(x), deep

    # ---- the phase
    def phase_encode(self, batch: node.Batch) -> node.Batch:
        grids = [self._grid(entry) for entry in batch]
        pixels = [self._pixels(entry, g) for entry, g in zip(batch, grids, strict=True)]
        dtype = self.pos_embed.weight.dtype
        empty = [{"embeds": torch.zeros(0, self.out_dim, dtype=dtype, device=self.device),
                  "deepstack": torch.zeros(len(self.deepstack), 0, self.out_dim, dtype=dtype, device=self.device)}
                 for _ in batch]
        busy = [i for i, g in enumerate(grids) if g]
        if not busy:
            return empty
        tokens, deep = self.encode(torch.cat([pixels[i] for i in busy]), [g for i in busy for g in grids[i]])
        counts = [sum(t * h * w for t, h, w in grids[i]) // self.merge**2 for i in busy]
        for i, tok, dp in zip(busy, tokens.split(counts), deep.split(counts, dim=1), strict=True):
            empty[i] = {"embeds": tok, "deepstack": dp}
        return empty

    def _grid(self, entry: Mapping[str, Any]) -> list[tuple[int, int, int]]:
        g = entry.get("grid")
        if not isinstance(g, torch.Tensor) or g.is_floating_point() or g.dim() != 2 or g.shape[1] != 3:
            got = f"{g.dtype} {list(g.shape)}" if isinstance(g, torch.Tensor) else type(g).__name__
            raise node.RequestError(f"grid must be an integer tensor [K, 3] of (t, h, w) patch counts, got {got}",
                                    "grid")
        rows = [tuple(int(v) for v in row) for row in g.tolist()]
        for t, h, w in rows:
            if t < 1 or h < 1 or w < 1 or h % self.merge or w % self.merge:
                raise node.RequestError(f"grid row ({t}, {h}, {w}) must be positive with h and w multiples of "
                                        f"{self.merge}", "grid")
            if max(h, w) > 200 * min(h, w):
                raise node.RequestError(f"grid row ({t}, {h}, {w}) has an aspect ratio above 200", "grid")
        return rows  # type: ignore[return-value]

    def _pixels(self, entry: Mapping[str, Any], grid: list[tuple[int, int, int]]) -> torch.Tensor:
        p = entry.get("pixels")
        want = sum(t * h * w for t, h, w in grid)
        if not isinstance(p, torch.Tensor) or not p.is_floating_point() or p.dim() != 2 \
                or p.shape[1] != self.patch_dim or p.shape[0] != want:
            got = f"{p.dtype} {list(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__
            raise node.RequestError(f"pixels must be a float tensor [{want}, {self.patch_dim}] (the grid's patches), "
                                    f"got {got}", "pixels")
        return p


def _args(spec: node.NodeSpec) -> dict[str, Any]:
    names = ("depth", "hidden", "heads", "intermediate", "patch", "temporal_patch", "merge", "positions",
             "deepstack", "out_dim")
    out = arch_values(spec, names, "qwen3_omni_vision")
    out["in_channels"] = int(spec.arch_args.get("in_channels", 3))
    return out
