"""A plain eager implementation of every testfamily walk: what the runtime's outputs must equal.

Same module weights as the nodes (it reads their parameters), none of the runtime's
machinery: no pages, no batching, no conductor, no stream buffers. Each KV context is a
dense per-layer K/V (`DenseKV`) that a step extends; attention is written out here; stream
chunks are slices computed from the chunk policies' definitions; a Parallel's branches are
separate forwards; a DynamicLoop is a Python loop. Nothing here imports the runtime beyond
the node classes.

Semantics it fixes (the runtime must agree):
  - `dynamic_loop ... until done` stops after the iteration whose `done` is true, or after
    `max_new_tokens` iterations; a `done` already true before the loop (bound by the prefill
    and carried) runs no iteration at all.
  - A stream's items are the codes of every token a prefill or kept decode step produced,
    except eos (which pushes no item). Chunks (start, end, context) per policy:
      fixed(K):           [s, min(s + K, n)) for s = 0, K, 2K, ... (the last may be partial)
      sliding(W, S):      windows ending at W, W + S, W + 2S, ... <= n; context 0 for the
                          first, W - S after; no partial tail
      left_context(C, L): new items [c, min(c + C, n)) for c = 0, C, 2C, ..., preceded by
                          min(c, L) context items
  - `emit X += v` concatenates along dim 0 in program order; `acc` likewise.
  - A transition keeps the context as it stands: chat's prompt and every token chat fed back
    (all its tokens but the last). `continue` takes chat's inputs and set outputs of the same
    names (so chat's `max_new`), else its defaults.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from mstar_models.testfamily.codec import TinyCodec
from mstar_models.testfamily.family import Family, stream_policy
from mstar_models.testfamily.lm import TinyLM

# ---------------------------------------------------------------------- dense KV + attention


@dataclass
class DenseKV:
    """One KV context (one request's tag), dense: K and V [n, kv_heads, head_dim] per layer,
    plus the LM's per-tag state (the runtime keeps the same dict with a paged context)."""

    layers: int
    k: list[torch.Tensor | None] = field(default_factory=list)
    v: list[torch.Tensor | None] = field(default_factory=list)
    length: int = 0
    state: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.k = self.k or [None] * self.layers
        self.v = self.v or [None] * self.layers

    def fork(self) -> DenseKV:
        """A full copy: what `fork node @a -> @b` means, minus the page sharing."""
        clone = [t.clone() if t is not None else None for t in self.k]
        return DenseKV(
            self.layers,
            clone,
            [t.clone() if t is not None else None for t in self.v],
            self.length,
            dict(self.state),
        )


class DenseAttention:
    """`attend(layer, q, k, v)` of ONE sequence over its dense context.

    mask "causal": query j (absolute position start + j) sees keys 0 .. start + j;
    mask "full": every key of the context and of the block. keep=False leaves the context
    unchanged (the block's K/V are used for this step only)."""

    def __init__(self, kv: DenseKV, mask: str = "causal", keep: bool = True):
        self.kv, self.mask, self.keep = kv, mask, keep

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        old_k, old_v = self.kv.k[layer], self.kv.v[layer]
        keys = k if old_k is None else torch.cat([old_k, k])
        values = v if old_v is None else torch.cat([old_v, v])
        if self.keep:
            self.kv.k[layer], self.kv.v[layer] = keys, values
        n_q, heads, dim = q.shape
        group = heads // keys.shape[1]
        keys = keys.float().repeat_interleave(group, dim=1)  # [n_k, heads, dim]
        values = values.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys) / math.sqrt(dim)
        if self.mask == "causal":
            n_k = keys.shape[0]
            q_pos = torch.arange(n_k - n_q, n_k)[:, None]
            scores = scores.masked_fill(torch.arange(n_k)[None, :] > q_pos, float("-inf"))
        elif self.mask != "full":
            raise ValueError(f"unsupported mask {self.mask!r}")
        return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(q.dtype)


# ---------------------------------------------------------------------- the LM, densely


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [n, heads, D]: dims i and i + D/2 rotate together by position * theta^(-2i/D)."""
    half = x.shape[-1] // 2
    angle = positions.double()[:, None] * theta ** (
        -torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1]
    )
    cos, sin = angle.cos().float()[:, None, :], angle.sin().float()[:, None, :]
    a, b = x[..., :half].float(), x[..., half:].float()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def lm_hidden(
    lm: TinyLM, kv: DenseKV, h: torch.Tensor, mask: str = "causal", keep: bool = True
) -> torch.Tensor:
    """Rows h [n, hidden] after the context -> final-normed hidden states [n, hidden]."""
    n = h.shape[0]
    positions = torch.arange(kv.length, kv.length + n)
    att = DenseAttention(kv, mask, keep)
    for i, layer in enumerate(lm.model.layers):
        a, mlp = layer.self_attn, layer.mlp
        x = _rms(h, layer.input_layernorm.weight, lm.eps)
        q = _rope(F.linear(x, a.q_proj.weight).view(n, lm.heads, lm.head_dim), positions, lm.rope_theta)
        k = _rope(F.linear(x, a.k_proj.weight).view(n, lm.kv_heads, lm.head_dim), positions, lm.rope_theta)
        v = F.linear(x, a.v_proj.weight).view(n, lm.kv_heads, lm.head_dim)
        h = h + F.linear(att.attend(i, q, k, v).reshape(n, -1), a.o_proj.weight)
        x = _rms(h, layer.post_attention_layernorm.weight, lm.eps)
        gate, up = F.linear(x, mlp.gate_proj.weight), F.linear(x, mlp.up_proj.weight)
        h = h + F.linear(gate * torch.sigmoid(gate) * up, mlp.down_proj.weight)
    if keep:
        kv.length += n
    return _rms(h, lm.model.norm.weight, lm.eps)


class LMStep(NamedTuple):
    token: int
    code: int | None  # None for eos: no stream item
    done: bool
    hidden: torch.Tensor  # [1, hidden]


def _lm_step(lm: TinyLM, kv: DenseKV, last: torch.Tensor) -> LMStep:
    head = lm.model.embed_tokens.weight if lm.tied else lm.lm_head.weight
    token = int(torch.argmax(last @ head.T))
    produced = kv.length - kv.state["gen_base"]
    done = token == lm.eos or produced >= kv.state["max_new"] or kv.length >= lm.max_context
    code = None if token == lm.eos else token % lm.codebook
    return LMStep(token, code, done, last[None, :])


@torch.no_grad()
def ref_prefill(lm: TinyLM, kv: DenseKV, ids: torch.Tensor, max_new: int) -> LMStep:
    kv.state["gen_base"] = kv.length + ids.numel() - 1
    kv.state["max_new"] = max_new
    hidden = lm_hidden(lm, kv, lm.model.embed_tokens.weight[ids.long()])
    return _lm_step(lm, kv, hidden[-1])


@torch.no_grad()
def ref_decode(lm: TinyLM, kv: DenseKV, token: int) -> LMStep:
    hidden = lm_hidden(lm, kv, lm.model.embed_tokens.weight[[token]])
    return _lm_step(lm, kv, hidden[-1])


@torch.no_grad()
def ref_denoise(lm: TinyLM, kv: DenseKV, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Velocity [L, C] of latent block x [L, C] at time t (f32[1]) against kv; kv is unchanged."""
    half = lm.hidden // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float().reshape(()) * 1000.0 * freqs
    temb = F.linear(torch.cat([args.cos(), args.sin()]), lm.flow_time.weight, lm.flow_time.bias)
    h = F.linear(x, lm.flow_in.weight, lm.flow_in.bias) + temb
    return F.linear(lm_hidden(lm, kv, h, mask="full", keep=False), lm.flow_out.weight, lm.flow_out.bias)


# ---------------------------------------------------------------------- codec and streams


class Window(NamedTuple):
    start: int
    end: int
    context: int


def chunk_windows(kind: str, params: Mapping[str, int], n: int) -> list[Window]:
    """The chunks a stream of n items yields under a policy, once it has closed."""
    if kind == "fixed":
        size = params["size"]
        return [Window(s, min(s + size, n), 0) for s in range(0, n, size)]
    if kind == "sliding":
        w, s = params["window"], params["stride"]
        return [Window(end - w, end, 0 if end == w else w - s) for end in range(w, n + 1, s)]
    if kind == "left_context":
        c, left = params["chunk"], params["left"]
        return [Window(max(0, s - left), min(s + c, n), min(s, left)) for s in range(0, n, c)]
    raise ValueError(f"unknown chunk policy {kind!r}")


@torch.no_grad()
def ref_codec(codec: TinyCodec, codes: torch.Tensor, context: int) -> torch.Tensor:
    """Samples of codes[context:] (hop per item), the earlier codes acting as causal context."""
    x = codec.embed.weight[codes.long()]  # [n, dim]
    padded = torch.cat([x.new_zeros(codec.kernel - 1, x.shape[1]), x])
    y = F.conv1d(padded.T[None], codec.conv.weight, codec.conv.bias)[0].T  # [n, dim]
    samples = torch.tanh(F.linear(x + F.silu(y), codec.up.weight, codec.up.bias))
    return samples[context:].reshape(-1)


# ---------------------------------------------------------------------- walks


def encode(family: Family, text: str) -> torch.Tensor:
    cfg = family.config
    return torch.tensor(
        [cfg["bos"]] + [b + cfg["byte_offset"] for b in text.encode("utf-8")], dtype=torch.int32
    )


@dataclass
class Generation:
    """A prefill + dynamic decode loop on one context."""

    steps: list[LMStep]  # the prefill's step, then one per loop iteration

    @property
    def tokens(self) -> torch.Tensor:
        return torch.tensor([s.token for s in self.steps], dtype=torch.int32)

    @property
    def codes(self) -> torch.Tensor:
        return torch.tensor([s.code for s in self.steps if s.code is not None], dtype=torch.int32)

    @property
    def loop_hidden(self) -> torch.Tensor:
        """`acc` of the loop iterations' hidden states (the prefill's is not accumulated)."""
        if len(self.steps) == 1:
            return torch.zeros(0, self.steps[0].hidden.shape[1])
        return torch.cat([s.hidden for s in self.steps[1:]])

    @property
    def done(self) -> bool:
        return self.steps[-1].done


def generate(family: Family, kv: DenseKV, ids: torch.Tensor, max_new: int) -> Generation:
    steps = [ref_prefill(family.lm, kv, ids, max_new)]
    for _ in range(int(family.config["max_new_tokens"])):  # while not done (the prefill's flag counts)
        if steps[-1].done:
            break
        steps.append(ref_decode(family.lm, kv, steps[-1].token))
    return Generation(steps)


def stream_audio(family: Family, walk: str, codes: torch.Tensor) -> tuple[torch.Tensor, list[Window]]:
    kind, params = stream_policy(walk, family.config)
    windows = chunk_windows(kind, params, codes.numel())
    parts = [ref_codec(family.codec, codes[w.start : w.end], w.context) for w in windows]
    return (torch.cat(parts) if parts else torch.zeros(0)), windows


def run_generate(
    family: Family, walk: str = "generate", prompt: str = "", max_new: int = 16
) -> dict[str, Any]:
    """generate / generate_fixed / generate_left. Returns the walk's outputs, plus `codes`
    (the stream's items) and `windows` (its chunks) for diagnosis."""
    gen = generate(family, DenseKV(family.lm.layers), encode(family, prompt), max_new)
    audio, windows = stream_audio(family, walk, gen.codes)
    out: dict[str, Any] = {"tokens": gen.tokens, "audio": audio, "codes": gen.codes, "windows": windows}
    if walk == "generate":
        out["hidden"] = gen.loop_hidden
    return out


@torch.no_grad()
def run_flow(
    family: Family, prompt: str, negative: str = "", steps: int = 4, scale: float = 2.0, seed: int = 0
) -> dict[str, Any]:
    lm, cfg = family.lm, family.config
    if not 0 <= steps <= int(cfg["max_flow_steps"]):
        raise ValueError(f"steps must be in [0, {cfg['max_flow_steps']}], got {steps}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((int(cfg["latent_len"]), int(cfg["latent_dim"])), generator=gen, dtype=torch.float32)
    uncond = DenseKV(lm.layers)
    ref_prefill(lm, uncond, encode(family, negative), 1)
    cond = uncond.fork()
    ref_prefill(lm, cond, encode(family, prompt), 1)
    trajectory = []
    for i in range(steps):
        t = torch.tensor([1.0 - i / steps], dtype=torch.float32)
        dt = torch.tensor([1.0 / steps], dtype=torch.float32)
        v_c, v_u = ref_denoise(lm, cond, x, t), ref_denoise(lm, uncond, x, t)  # two dense forwards
        x = x - dt * (v_u + scale * (v_c - v_u))
        trajectory.append(x)
    latent_dim = int(cfg["latent_dim"])
    return {"latent": x, "trajectory": torch.cat(trajectory) if trajectory else torch.zeros(0, latent_dim)}


def run_chat(family: Family, prompt: str, max_new: int = 8) -> tuple[dict[str, Any], DenseKV]:
    """The chat walk's outputs and its @main context (which the transition keeps)."""
    kv = DenseKV(family.lm.layers)
    gen = generate(family, kv, encode(family, prompt), max_new)
    return {"tokens": gen.tokens, "handoff": gen.done}, kv


def run_continue(family: Family, kv: DenseKV, text: str = " ok", max_new: int = 8) -> dict[str, Any]:
    """The continue walk on a kept context (chat's @main, now @cont)."""
    return {"tokens": generate(family, kv, encode(family, text), max_new).tokens}


WALK_DEFAULTS: dict[str, dict[str, Any]] = {
    "generate": {"max_new": 16},
    "generate_fixed": {"max_new": 16},
    "generate_left": {"max_new": 16},
    "flow": {"negative": "", "steps": 4, "scale": 2.0, "seed": 0},
    "chat": {"max_new": 8},
    "continue": {"text": " ok", "max_new": 8},
}


def run_request(family: Family, walk: str, inputs: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """One request from `walk`, following the transition chat -> continue when `handoff`.

    Returns [(walk, outputs), ...] in order; outputs are exactly the walk's outputs. A walk
    started by a transition takes the previous walk's inputs (and set outputs) of the same
    names, else its defaults: `continue` gets chat's `max_new` and the default `text`."""
    args = {**WALK_DEFAULTS[walk], **inputs}
    if walk in ("generate", "generate_fixed", "generate_left"):
        out = run_generate(family, walk, **args)
        keep = ("tokens", "hidden", "audio") if walk == "generate" else ("tokens", "audio")
        return [(walk, {k: out[k] for k in keep})]
    if walk == "flow":
        return [(walk, run_flow(family, **args))]
    if walk == "continue":
        raise ValueError("'continue' runs on a context kept by chat; start the request at 'chat'")
    if walk != "chat":
        raise ValueError(f"unknown walk {walk!r}")
    chat, kv = run_chat(family, **args)
    result = [("chat", chat)]
    if chat["handoff"]:
        carried = {**args, "handoff": chat["handoff"]}
        defaults = WALK_DEFAULTS["continue"]
        cont_args = {k: carried.get(k, v) for k, v in defaults.items()}
        result.append(("continue", run_continue(family, kv, **cont_args)))
    return result
