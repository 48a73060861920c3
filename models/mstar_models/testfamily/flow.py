"""TinyFlow: the flow-matching sampler's arithmetic (stateless, no weights).

The latent goes from noise at t = 1 to data at t = 0 on the grid t_i = 1 - i / steps; the
velocity points towards the noise, so an Euler step is x <- x - dt * v with the
classifier-free-guidance velocity v = v_uncond + scale * (v_cond - v_uncond).
"""

from __future__ import annotations

import torch

from mstar_models.testfamily.common import as_float, as_int, setting
from mstar_runtime.ops import node


def noise(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """x0 ~ N(0, I) from a CPU generator seeded by the request: the same on every device."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


class TinyFlow(node.StatelessNode):
    """init(seed: int) -> (x: f32[L, C]); time(index: int, steps: int) -> (t: f32[1], dt: f32[1]);
    step(x, v_cond, v_uncond: f32[L, C], dt: f32[1], scale: float) -> (x: f32[L, C])."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.shape = (int(setting(spec, "latent_len")), int(setting(spec, "latent_dim")))

    def _tensor(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(device=self.spec.device, dtype=self.spec.dtype)

    def phase_init(self, batch: node.Batch) -> node.Batch:
        # One generator per request is the point (per-request seeds), so this loop is the work.
        return [{"x": self._tensor(noise(as_int(entry, "seed"), self.shape))} for entry in batch]

    def phase_time(self, batch: node.Batch) -> node.Batch:
        out: node.Batch = []
        for entry in batch:
            index, steps = as_int(entry, "index"), as_int(entry, "steps")
            if steps < 1 or not 0 <= index < steps:
                raise node.RequestError(f"need 0 <= index < steps, got index={index} steps={steps}", "index")
            t = torch.tensor([1.0 - index / steps], dtype=torch.float32)
            dt = torch.tensor([1.0 / steps], dtype=torch.float32)
            out.append({"t": self._tensor(t), "dt": self._tensor(dt)})
        return out

    def phase_step(self, batch: node.Batch) -> node.Batch:
        x = torch.stack([entry["x"] for entry in batch])
        v_cond = torch.stack([entry["v_cond"] for entry in batch])
        v_uncond = torch.stack([entry["v_uncond"] for entry in batch])
        dt = torch.stack([entry["dt"].reshape(1) for entry in batch]).view(-1, 1, 1).to(x.dtype)
        scale = torch.tensor([as_float(entry, "scale") for entry in batch], dtype=x.dtype, device=x.device)
        v = v_uncond + scale.view(-1, 1, 1) * (v_cond - v_uncond)
        return [{"x": row} for row in (x - dt * v).unbind(0)]
