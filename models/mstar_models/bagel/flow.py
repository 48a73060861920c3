"""BAGEL's flow-matching arithmetic as a stateless node (no weights): noise, schedule, guidance, Euler step.

The official `Bagel.generate_image` / `_forward_flow` (docs/models/bagel.md, Facts), phase by phase
(models/bagel/bagel.walk, node `flow`):

  noise(height, width, seed, skip) -> (latent)
      x_1 ~ N(0, I) of [h*w, 64], h = height/16, w = width/16, drawn on the CPU from a
      generator seeded with `seed` after `skip` draws, as the official `prepare_vae_latent`
      draws it from the CPU's global RNG (then moved to the node's device). `skip` is what the
      edit's VAE encoder drew from that same generator before (its posterior, when it ran on
      the CPU): the official order is posterior first, then noise.
  schedule(num_timesteps) -> (steps)
      num_timesteps - 1 Euler steps (linspace(1, 0, n) drops its last point).
  time(index, num_timesteps, shift) -> (t, dt)
      t = linspace(1, 0, n) shifted as s*t / (1 + (s-1)*t), in float32 as the official code;
      dt = t[i] - t[i+1].
  guide(latent, t, cfg_text_scale, cfg_img_scale, cfg_interval_start, cfg_interval_end)
      -> (q_text, q_img)
      which CFG branches this step computes: inside the interval (start < t <= end) a branch
      whose scale is > 1 gets the latent as its query, any other gets an empty [0, 64] one,
      which the LLM's denoise answers with an empty velocity and no work. The image branch is
      off too when the text branch is: the official combination then uses v alone.
  step(latent, v, v_text, v_img, t, dt, cfg_text_scale, cfg_img_scale, cfg_interval_start,
       cfg_interval_end, cfg_renorm_type, cfg_renorm_min) -> (latent)
      the CFG combination and renorm ("global", "channel", "text_channel"), then
      x <- x - v * dt (the velocity points from data to noise). An empty v_text means no
      CFG this step (v as is); an empty v_img means the image branch was not computed: with
      cfg_img_scale <= 1 it is not used, and otherwise its context held the same tokens as
      gen's (the engine computed it once, see engine/engines.py), so v_img = v.

Requests batch: time/schedule are host arithmetic per entry; step runs per entry on the
device (each request's own norms and scales; a few element-wise kernels on [h*w, 64]).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mstar_runtime.ops import node

PATCH_DIM = 64  # 2 x 2 latent patch x 16 FLUX channels at real size; the config says per variant
RENORM_TYPES = ("global", "channel", "text_channel")


def shifted_times(num_timesteps: int, shift: float) -> torch.Tensor:
    """The official schedule: linspace(1, 0, n) then s*t / (1 + (s-1)*t), float32."""
    t = torch.linspace(1, 0, num_timesteps)
    return shift * t / (1 + (shift - 1) * t)


def in_interval(t: float, start: float, end: float) -> bool:
    return start < t <= end


def combine(v: torch.Tensor, v_text: torch.Tensor | None, v_img: torch.Tensor | None, text_scale: float,
            img_scale: float, renorm_type: str, renorm_min: float) -> torch.Tensor:
    """The official CFG combination of one request's velocities ([h*w, C]); v_text None: no CFG."""
    if v_text is None:
        return v
    if v_img is None:
        v_img = v
    v_t = v_text + text_scale * (v - v_text)
    if renorm_type == "text_channel":
        scale = (v.norm(dim=-1, keepdim=True) / (v_t.norm(dim=-1, keepdim=True) + 1e-8)).clamp(
            min=renorm_min, max=1.0)
        v_t = v_t * scale
        return v_img + img_scale * (v_t - v_img) if img_scale > 1.0 else v_t
    out = v_img + img_scale * (v_t - v_img) if img_scale > 1.0 else v_t
    if renorm_type == "global":
        scale = (v.norm() / (out.norm() + 1e-8)).clamp(min=renorm_min, max=1.0)
    else:  # "channel"
        scale = (v.norm(dim=-1, keepdim=True) / (out.norm(dim=-1, keepdim=True) + 1e-8)).clamp(
            min=renorm_min, max=1.0)
    return out * scale


class FlowStep(node.StatelessNode):
    """noise / schedule / time / guide / step; see the module docstring."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.patch_dim = int(spec.config.get("patch_dim", PATCH_DIM))
        self.max_latent = int(spec.config["max_latent_size"])
        self.max_timesteps = int(spec.config["max_timesteps"])

    # ------------------------------------------------------------------ phases
    def phase_noise(self, batch: node.Batch) -> node.Batch:
        out = []
        for e in batch:
            h, w = self._grid(e)
            seed, skip = _int(e, "seed"), _int(e, "skip", 0)
            if skip < 0:
                raise node.RequestError(f"skip must be >= 0, got {skip}", "skip")
            g = torch.Generator().manual_seed(seed)
            if skip:
                torch.randn(skip, generator=g)  # the draws an earlier node took from this stream
            x = torch.randn(h * w, self.patch_dim, generator=g)
            out.append({"latent": x.to(self.spec.device)})
        return out

    def phase_schedule(self, batch: node.Batch) -> node.Batch:
        return [{"steps": self._timesteps(e) - 1} for e in batch]

    def phase_time(self, batch: node.Batch) -> node.Batch:
        out = []
        for e in batch:
            n, i, shift = self._timesteps(e), _int(e, "index"), _float(e, "shift")
            if not shift > 0:
                raise node.RequestError(f"shift must be > 0, got {shift}", "shift")
            if not 0 <= i < n - 1:
                raise node.RequestError(f"index {i} is outside the {n - 1} Euler steps", "index")
            t = shifted_times(n, shift)
            out.append({"t": float(t[i]), "dt": float(t[i] - t[i + 1])})
        return out

    def phase_guide(self, batch: node.Batch) -> node.Batch:
        out = []
        for e in batch:
            x, t = _latent(e, "latent", self.patch_dim), _float(e, "t")
            on = in_interval(t, _float(e, "cfg_interval_start"), _float(e, "cfg_interval_end"))
            text = on and _float(e, "cfg_text_scale") > 1.0
            img = text and _float(e, "cfg_img_scale") > 1.0
            empty = x.new_zeros((0, self.patch_dim))
            out.append({"q_text": x if text else empty, "q_img": x if img else empty})
        return out

    def phase_step(self, batch: node.Batch) -> node.Batch:
        out = []
        for e in batch:
            x = _latent(e, "latent", self.patch_dim)
            v = _latent(e, "v", self.patch_dim)
            v_text, v_img = _latent(e, "v_text", self.patch_dim), _latent(e, "v_img", self.patch_dim)
            if v.shape != x.shape or any(b.shape[0] not in (0, x.shape[0]) for b in (v_text, v_img)):
                raise node.RequestError(f"velocities {tuple(v.shape)}, {tuple(v_text.shape)}, {tuple(v_img.shape)} "
                                        f"do not match the latent {tuple(x.shape)}", "v")
            renorm = e.get("cfg_renorm_type")
            if renorm not in RENORM_TYPES:
                raise node.RequestError(f"cfg_renorm_type must be one of {', '.join(RENORM_TYPES)}, got {renorm!r}",
                                        "cfg_renorm_type")
            t, dt = _float(e, "t"), _float(e, "dt")
            text_scale, img_scale = _float(e, "cfg_text_scale"), _float(e, "cfg_img_scale")
            on = in_interval(t, _float(e, "cfg_interval_start"), _float(e, "cfg_interval_end"))
            use_text = on and text_scale > 1.0 and v_text.shape[0] > 0
            vel = combine(v.float(), v_text.float() if use_text else None,
                          v_img.float() if v_img.shape[0] else None, text_scale,
                          img_scale if on else 1.0, renorm, _float(e, "cfg_renorm_min"))
            out.append({"latent": x - vel * dt})
        return out

    # ------------------------------------------------------------------ checks
    def _grid(self, e: dict[str, Any]) -> tuple[int, int]:
        h, w = _int(e, "height"), _int(e, "width")
        most = 16 * self.max_latent
        for name, px in (("height", h), ("width", w)):
            if px < 16 or px % 16 or px > most:
                raise node.RequestError(f"{name} must be a multiple of 16 in 16..{most} (the plan's "
                                        f"max_latent_size is {self.max_latent}), got {px}", name)
        return h // 16, w // 16

    def _timesteps(self, e: dict[str, Any]) -> int:
        n = _int(e, "num_timesteps")
        if not 2 <= n <= self.max_timesteps + 1:
            raise node.RequestError(f"num_timesteps must be in 2..{self.max_timesteps + 1} (the plan's "
                                    f"max_timesteps is {self.max_timesteps} Euler steps), got {n}", "num_timesteps")
        return n


def _int(e: dict[str, Any], port: str, default: int | None = None) -> int:
    value = e.get(port, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise node.RequestError(f"{port} must be an integer, got {type(value).__name__}", port)
    return value


def _float(e: dict[str, Any], port: str) -> float:
    value = e.get(port)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise node.RequestError(f"{port} must be a finite number, got {value!r}", port)
    return float(value)


def _latent(e: dict[str, Any], port: str, dim: int) -> torch.Tensor:
    x = e.get(port)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != dim:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise node.RequestError(f"{port} must be a [tokens, {dim}] latent, got {got}", port)
    return x
