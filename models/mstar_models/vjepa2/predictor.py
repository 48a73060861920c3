"""The V-JEPA 2-AC action-conditioned predictor as a KV node (official `VisionTransformerPredictorAC`).

Sequence (official `forward`): per time step t one block `[action_t, state_t, frame_t tokens]`
(2 + 256 tokens at 256 px), `predictor_embed` 1408->1024 on frame tokens, `action_encoder` /
`state_encoder` 7->1024 on the conditioning tokens, 24 pre-norm blocks under a frame-block-
causal mask (a block sees itself and every earlier block), then `predictor_norm` and
`predictor_proj` 1024->1408 on the frame tokens; the outputs at block t predict frame t+1.
RoPE: frame tokens at (t, h, w), action and state tokens rotate only the temporal part
(layers.py). `extrinsics_encoder` is in the checkpoint but unused (`use_extrinsics=False`).

Why a KV node: positions are absolute and the mask is block-causal, so the K/V of block t
never change when block t+1 is appended. A rollout step runs ONE new block per trajectory
over the cached ones, where the official loop re-runs all (h+1) blocks at every step h.

Rows. A request's context holds B trajectories ("rows", e.g. the CEM samples) that share
their history. Layout of the request's KV context (one tag):
    [history blocks 0..T-2 (shared, written once by prefill)]
    [step 0: row 0 block, row 1 block, ..., row B-1 block]
    [step 1: row 0 block, ...] ...
Row b attends to the history and to its own blocks only. With B == 1 that is exactly the
contiguous block-causal sequence, and the step goes through the engine's `attn.attend`
(`SeqPlan(mask="block_causal", block_size=2 + tokens_per_frame)`, paged, FlashInfer on GPU)
inside `attn.run_graphed`: its one new block sees the whole context, so on a GPU the engine
replays it from a CUDA graph per batch bucket (`graph_step_tokens`: every entry of such a
step adds exactly 2 + tokens_per_frame tokens; engine/graphs.py).
With B > 1 no mask of the engine says "the history plus my own blocks", so the node attends
per row itself (`attn.extra["pool"]` / `["metadata"]`, the hook the engine provides for
nodes that need more than `attend`): `row_layout` splits the step into one attention entry
per row (its block's queries; the pool slots of the history and of the row's own blocks as
its keys), the node writes the new K/V into its reserved slots and runs FlashInfer over
those token lists on a GPU (`flashinfer_backend.FlashInferRowPrefill`: pages of one token,
one non-causal prefill for all rows of the step), else gathers each row's keys and runs SDPA.
One step of all rows is still ONE entry of the engine, so all CEM samples of a request are one
batched call whatever their number (the language's KV tags are static names, so a per-sample
tag or fork is not expressible for S samples). That entry declares mask "full" to the engine:
the engine's attention never serves it, and a block-causal declaration would make the engine's
backend plan a q x kv custom mask of the whole step (400 rows x 258 tokens: 10^10 mask bits,
whose 32-bit offsets overflow FlashInfer's plan, BENCHMARKS.md "negative dimension"; a failed
custom-mask plan then sent every later custom-mask step of the backend to the reference).

Phases (node state per (request, tag): T, history length, rows, steps done):
- prefill(frames [T,N,E], states [T,7], actions [B,A,7]) writes history blocks 0..T-2 with
  the history actions `actions[:, t]` (every row must agree on them: the history is shared)
  and returns the last context frame and state (one row; `step` broadcasts it). It needs an
  empty context: a walk restarts one by forking an empty tag over it.
- step(frame [1|B,N,E], state [1|B,7], actions [B,A,7]) appends block t = T-1+steps for every
  row with `actions[:, t]` and returns the next frame (layer-normed with `normalize_reps`, as
  the official `step_predictor`) and the pose `compute_new_pose(state, actions[:, t])`.
Outputs are in the node's compute dtype (f32 at the tiny size keeps float32 parity).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.vjepa2.layers import LN_EPS, Block, rope_tables
from mstar_models.vjepa2.pose import compute_new_pose
from mstar_runtime.ops import node
from mstar_runtime.ops.readback import upload, upload_tensor

log = logging.getLogger(__name__)

COND_TOKENS = 2  # action, state (3 with extrinsics, which the released model does not use)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _geometry(spec: node.NodeSpec) -> tuple[int, int, int]:
    """(tokens per frame, tokens per step, max steps) from the plan's config and settings."""
    tpf = int(spec.config["tokens_per_frame"])
    max_steps = int(spec.settings.get("max_steps", spec.config.get("max_steps", 32)))
    return tpf, tpf + COND_TOKENS, max_steps


class ACPredictor(node.KVNode):
    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        a = spec.arch_args
        dev, dt = spec.device, spec.dtype
        self.enc_dim, self.dim, self.heads = int(a["enc_dim"]), int(a["dim"]), int(a["heads"])
        self.head_dim = self.dim // self.heads
        self.tokens_per_frame, self.tokens_per_step, self.max_steps = _geometry(spec)
        self.grid = int(round(self.tokens_per_frame**0.5))
        self.normalize_reps = bool(spec.settings.get("normalize_reps", True))
        self.predictor_embed = nn.Linear(self.enc_dim, self.dim, device=dev, dtype=dt)
        self.action_encoder = nn.Linear(int(a.get("action_dim", 7)), self.dim, device=dev, dtype=dt)
        self.state_encoder = nn.Linear(int(a.get("state_dim", 7)), self.dim, device=dev, dtype=dt)
        self.extrinsics_encoder = nn.Linear(int(a.get("extrinsics_dim", 6)), self.dim, device=dev, dtype=dt)
        self.predictor_blocks = nn.ModuleList(
            Block(self.dim, self.heads, int(a["mlp"]), True, dev, dt) for _ in range(int(a["depth"]))
        )
        self.predictor_norm = nn.LayerNorm(self.dim, eps=LN_EPS, device=dev, dtype=dt)
        self.predictor_proj = nn.Linear(self.dim, self.enc_dim, device=dev, dtype=dt)
        # A single-trajectory step adds one block per entry over its whole context: the engine's
        # GraphRunner replays it from CUDA graphs (engine/graphs.py)
        self.graph_step_tokens = {"step": self.tokens_per_step}
        # "auto": FlashInfer for the per-row attention of multi-row steps where it serves the
        # pool, "reference": gathered keys and SDPA everywhere (tests compare the two)
        self.row_attention = "auto"
        self._row_kernels: dict[int, object | None] = {}  # id(pool) -> FlashInferRowPrefill or None

    @property
    def kv_geometry(self) -> node.KVGeometry:
        return node.KVGeometry(len(self.predictor_blocks), self.heads, self.head_dim)

    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: node.NodeSpec) -> node.SeqPlan:
        _, per, max_steps = _geometry(spec)
        if phase == "prefill":
            steps = shapes["frames"][0]
            if not 1 <= steps <= max_steps:
                raise node.RequestError(f"the context needs 1 to {max_steps} frames, got {steps}", "frames")
            return node.SeqPlan((steps - 1) * per, mask="block_causal", block_size=per)
        if phase == "step":
            rows = shapes["actions"][0]
            if rows < 1:
                raise node.RequestError("actions need at least one trajectory", "actions")
            if rows > 1:  # the node attends per row itself; see the module docstring for "full"
                return node.SeqPlan(rows * per, mask="full")
            return node.SeqPlan(rows * per, mask="block_causal", block_size=per)
        raise node.NodeError(f"node '{spec.name}' has no phase '{phase}'")

    # ------------------------------------------------------------------ tensors
    def embed(self, frames: torch.Tensor, states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Blocks [a, s, frame tokens] of frames [R, N, E], states/actions [R, 7] -> [R * per, dim]."""
        dt = self.predictor_embed.weight.dtype
        z = self.predictor_embed(frames.to(dt))
        a = self.action_encoder(actions.to(dt))[:, None]
        s = self.state_encoder(states.to(dt))[:, None]
        return torch.cat([a, s, z], dim=1).flatten(0, 1)

    def rope(self, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [R * per, head_dim] for R blocks at time steps `steps` [R]."""
        per, g = self.tokens_per_step, self.grid
        i = torch.arange(per, device=steps.device) - COND_TOKENS
        frame = i >= 0
        h = torch.where(frame, i.clamp(min=0) // g, 0).float()  # cond tokens: h = w = 0 (time only)
        w = torch.where(frame, i.clamp(min=0) % g, 0).float()
        t = steps.float()[:, None].expand(-1, per)
        rows = steps.shape[0]
        return rope_tables(t.reshape(-1), h.repeat(rows), w.repeat(rows), self.head_dim,
                           self.predictor_embed.weight.dtype)

    def stack(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Packed tokens [N, dim] through every block and the output head -> [N, enc_dim]."""
        for i, blk in enumerate(self.predictor_blocks):
            q, k, v = blk.attn.qkv_heads(blk.norm1(x), cos, sin)
            x = x + blk.attn.proj(attend(i, q, k, v).flatten(1))
            x = blk.mlp_residual(x)
        return self.predictor_proj(self.predictor_norm(x))

    def frame_outputs(self, out: torch.Tensor) -> torch.Tensor:
        """[R * per, enc_dim] -> the frame tokens of each block [R, N, enc_dim], normalised."""
        z = out.view(-1, self.tokens_per_step, self.enc_dim)[:, COND_TOKENS:]
        return F.layer_norm(z, (self.enc_dim,)) if self.normalize_reps else z

    # ------------------------------------------------------------------ phases
    def phase_prefill(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        parts, outs = [], []
        dev = self.spec.device  # walk inputs (the context pose, say) arrive on the host
        for entry, seq in zip(batch, attn.seqs):
            frames, states, actions = (upload_tensor(entry[k], dev) for k in ("frames", "states", "actions"))
            steps = int(frames.shape[0])
            self._check_frames(frames, "frames")
            if tuple(states.shape) != (steps, self.action_encoder.in_features):
                raise node.RequestError(f"states must be [{steps}, 7] (one per context frame), got "
                                        f"{list(states.shape)}", "states")
            if actions.dim() != 3 or actions.shape[1] < steps - 1:
                raise node.RequestError(f"actions must be [B, >= {steps - 1}, 7] (the history actions first), "
                                        f"got {list(actions.shape)}", "actions")
            hist = actions[:1, : steps - 1]
            if steps > 1 and not torch.equal(actions[:, : steps - 1], hist.expand(actions.shape[0], -1, -1)):
                raise node.RequestError("every trajectory must share the history actions "
                                        f"actions[:, :{steps - 1}] (the context is shared)", "actions")
            if seq.start != 0:
                raise node.RequestError("predictor.prefill needs an empty KV context; restart it by forking "
                                        "an empty tag over it", "frames")
            seq.state.clear()
            seq.state.update(T=steps, hist=(steps - 1) * self.tokens_per_step, rows=None, done=0)
            if steps > 1:
                parts.append((self.embed(frames[:-1], states[:-1], hist[0]),
                              torch.arange(steps - 1, device=frames.device)))
            outs.append({"frame": frames[-1:].to(self.spec.dtype), "state": states[-1:].float()})
        if parts:
            x = torch.cat([p[0] for p in parts])
            cos, sin = self.rope(torch.cat([p[1] for p in parts]))
            attn.run_graphed(lambda x, c, s: self.stack(x, c, s, attn.attend), x, cos, sin)
        return outs

    def phase_step(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        per = self.tokens_per_step
        xs, steps, rows_of, news = [], [], [], []
        for entry, seq in zip(batch, attn.seqs):
            st = seq.state
            if "T" not in st:
                raise node.RequestError("predictor.step before predictor.prefill on this context", "actions")
            actions = upload_tensor(entry["actions"], self.spec.device)
            rows, t = int(actions.shape[0]), st["T"] - 1 + st["done"]
            if t >= self.max_steps:
                raise node.RequestError(f"step {t} is past the predictor's {self.max_steps} steps "
                                        "(context frames + horizon)", "actions")
            if actions.dim() != 3 or actions.shape[1] <= t:
                raise node.RequestError(f"step {t} needs actions[:, {t}]; got actions {list(actions.shape)}", "actions")
            if st["rows"] not in (None, rows):
                raise node.RequestError(f"a rollout keeps its {st['rows']} trajectories; got {rows}", "actions")
            frame = self._rows(upload_tensor(entry["frame"], self.spec.device), rows, "frame")
            state = self._rows(upload_tensor(entry["state"], self.spec.device), rows, "state")
            self._check_frames(frame, "frame")
            if seq.start != st["hist"] + st["done"] * rows * per:
                raise node.NodeError(f"node '{self.spec.name}': KV context at {seq.start} tokens, expected "
                                     f"{st['hist'] + st['done'] * rows * per}")
            act = actions[:, t]
            xs.append(self.embed(frame, state, act))
            steps.append(torch.full((rows,), t, device=act.device))
            rows_of.append(rows)
            news.append(compute_new_pose(state.float(), act.float()))
        x = torch.cat(xs)
        cos, sin = self.rope(torch.cat(steps))
        if all(r == 1 for r in rows_of):
            out = attn.run_graphed(lambda x, c, s: self.stack(x, c, s, attn.attend), x, cos, sin)
        else:
            out = self.stack(x, cos, sin, self._row_attend(attn, rows_of))
        frames = torch.split(self.frame_outputs(out), rows_of)
        for seq, rows in zip(attn.seqs, rows_of):
            seq.state["rows"] = rows
            seq.state["done"] += 1
        return [{"frame": f, "state": s} for f, s in zip(frames, news)]

    # ------------------------------------------------------------------ per-row attention
    def _row_attend(self, attn: node.AttentionContext, rows_of: list[int]) -> Attend:
        """Attention where row b of an entry sees the shared history and its own blocks only."""
        pool = attn.extra["pool"]
        meta = attn.extra["metadata"]
        entries = [RowEntry(seq.start, seq.state["hist"], seq.state["done"], rows, meta.seqs[k].page_table)
                   for k, (seq, rows) in enumerate(zip(attn.seqs, rows_of))]
        layout = row_layout(entries, self.tokens_per_step, pool.page_size, pool.device)
        new_pages, new_offsets = layout.new_slots // pool.page_size, layout.new_slots % pool.page_size
        kernel = self._row_kernel(pool, layout)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            data = pool.data[layer]
            data[new_pages, 0, new_offsets] = k.to(data.dtype)
            data[new_pages, 1, new_offsets] = v.to(data.dtype)
            if kernel is not None:
                return kernel.run(q, layer)
            return row_attention_reference(q, pool, layer, layout, self.heads, self.head_dim)

        return attend

    def _row_kernel(self, pool: Any, layout: RowLayout) -> Any:
        """The FlashInfer row attention planned for this step, or None (the reference serves it)."""
        if self.row_attention != "auto":
            return None
        key = id(pool)
        if key not in self._row_kernels:
            from mstar_runtime.kv.flashinfer_backend import row_prefill  # imports flashinfer lazily

            self._row_kernels[key] = row_prefill(pool)
        kernel = self._row_kernels[key]
        if kernel is None:
            return None
        try:
            kernel.plan(layout.qo_indptr, layout.kv_indptr, layout.visible, self.heads, None)  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - the reference computes the same; say so once
            log.warning("node '%s': FlashInfer per-row plan failed (%s: %s); per-row attention uses the "
                        "reference from now on", self.spec.name, type(e).__name__, e)
            self._row_kernels[key] = None
            return None
        return kernel

    # ------------------------------------------------------------------ checks
    def _check_frames(self, frames: torch.Tensor, port: str) -> None:
        if frames.dim() != 3 or tuple(frames.shape[1:]) != (self.tokens_per_frame, self.enc_dim):
            raise node.RequestError(f"{port} must be [*, {self.tokens_per_frame}, {self.enc_dim}], got "
                                    f"{list(frames.shape)}", port)

    @staticmethod
    def _rows(x: torch.Tensor, rows: int, port: str) -> torch.Tensor:
        if x.shape[0] == rows:
            return x
        if x.shape[0] == 1:
            return x.expand(rows, *x.shape[1:])
        raise node.RequestError(f"{port} has {x.shape[0]} rows; the actions have {rows} trajectories", port)


# ---------------------------------------------------------------------------- rows as attention entries
@dataclass(frozen=True)
class RowEntry:
    """One engine entry of a multi-row step, as the row split needs it."""

    start: int  # KV tokens of the context before this step
    hist: int  # shared history tokens at the front of the context
    done: int  # steps already appended for every row
    rows: int
    page_table: Sequence[int]


@dataclass(frozen=True)
class RowLayout:
    """A multi-row step as attention entries, one per row (all entries' rows, in packed order):
    entry r's queries are packed rows qo_indptr[r]..qo_indptr[r+1]-1 (its new block) and it
    sees the pool slots visible[kv_indptr[r]:kv_indptr[r+1]] (the history, then its own blocks
    of every step so far, this one last), all of them (no mask within)."""

    qo_indptr: list[int]
    kv_indptr: list[int]
    new_slots: torch.Tensor  # [tokens] long: where the step's new K/V go, in packed order
    visible: torch.Tensor  # [kv_indptr[-1]] long: pool slots each row attends to
    groups: list[tuple[int, int, int]]  # per engine entry: (first row, rows, keys per row)


def row_layout(entries: Sequence[RowEntry], per: int, page_size: int, device: torch.device | str) -> RowLayout:
    """Split a step's entries into rows (the module docstring's context layout: history, then
    per step one block per row): positions come from the node state, slots from each entry's
    page table (uploaded without a host wait), all on `device`."""
    dev = torch.device(device)
    qo, kv, groups = [0], [0], []
    news, seen = [], []
    row = 0
    for e in entries:
        length = e.hist + (e.done + 1) * per
        table = upload(list(e.page_table), torch.long, dev)
        new = torch.arange(e.start, e.start + e.rows * per, device=dev)
        own = (e.hist + torch.arange(e.done + 1, device=dev)[None, :, None] * e.rows * per
               + torch.arange(e.rows, device=dev)[:, None, None] * per
               + torch.arange(per, device=dev)[None, None, :]).flatten(1)  # [rows, (done+1)*per]
        pos = torch.cat([torch.arange(e.hist, device=dev).expand(e.rows, -1), own], dim=1).flatten()
        news.append(table[new // page_size] * page_size + new % page_size)
        seen.append(table[pos // page_size] * page_size + pos % page_size)
        for _ in range(e.rows):
            qo.append(qo[-1] + per)
            kv.append(kv[-1] + length)
        groups.append((row, e.rows, length))
        row += e.rows
    return RowLayout(qo, kv, torch.cat(news), torch.cat(seen), groups)


def row_attention_reference(q: torch.Tensor, pool: Any, layer: int, layout: RowLayout, heads: int,
                            head_dim: int) -> torch.Tensor:
    """The rows' attention from gathered keys: per engine entry one SDPA over its rows (they
    all see the same number of keys); what FlashInferRowPrefill computes."""
    data = pool.data[layer]
    ps = pool.page_size
    out = torch.empty_like(q)
    per = layout.qo_indptr[1] - layout.qo_indptr[0] if len(layout.qo_indptr) > 1 else 0
    for first, rows, length in layout.groups:
        a, b = layout.kv_indptr[first], layout.kv_indptr[first + rows]
        slots = layout.visible[a:b]
        pages, offsets = slots // ps, slots % ps
        keys = data[pages, 0, offsets].to(q.dtype).view(rows, length, heads, head_dim).transpose(1, 2)
        vals = data[pages, 1, offsets].to(q.dtype).view(rows, length, heads, head_dim).transpose(1, 2)
        qa, qb = layout.qo_indptr[first], layout.qo_indptr[first + rows]
        qr = q[qa:qb].view(rows, per, heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qr, keys, vals)
        out[qa:qb] = o.transpose(1, 2).reshape(qb - qa, heads, head_dim)
    return out
