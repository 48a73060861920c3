"""The cross-entropy-method planner of the official `notebooks/utils/mpc_utils.cem`, as a node.

The official CEM keeps a 4-D mean/std per horizon step (xyz, gripper) and writes 7-D actions
(xyz, three zero rotation deltas, gripper). Here mean/std are the 7-D rows the walk carries,
with the rotation dims held at mean 0 / std 0, which is the same distribution.
- init: mean 0; std `maxnorm` on xyz, 1 on the gripper.
- sample: for h in 0..H-1, `randn(samples, 4)` (the official draw: one [samples, 4] normal
  per horizon step, in order) * std[h] + mean[h]; xyz clipped to +-maxnorm, gripper to
  +-0.75; rotations 0. The generator is seeded from (seed, iteration) (`cem_generator`) and
  draws on the CPU, so a plan is reproducible on any device and independent of batching.
- score: L1 energy `mean |z_H - z_goal|` over tokens and dims of the last predicted frame.
- refit: the `topk` lowest energies; new = momentum * old + (1 - momentum) * top-k statistic
  (mean, and the unbiased std as `torch.std`), with the gripper's own momenta.
- first: the first action of the mean; MPC executes it and replans.
Every phase loops over the entries of its batch: the work is a few small tensors per request.
"""

from __future__ import annotations

import hashlib

import torch

from mstar_runtime.ops import node

XYZ = slice(0, 3)
GRIPPER = 6
CEM_DIMS = [0, 1, 2, 6]  # the 4 dims the official CEM samples
GRIPPER_CLIP = 0.75


def cem_generator(seed: int, iteration: int) -> torch.Generator:
    """The CPU generator of one CEM iteration: a stable hash of (seed, iteration)."""
    digest = hashlib.sha256(f"vjepa2-cem/{seed}/{iteration}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def cem_noise(seed: int, iteration: int, samples: int, horizon: int) -> torch.Tensor:
    """Standard normals [horizon, samples, 4] in the official draw order (one draw per step)."""
    g = cem_generator(seed, iteration)
    return torch.stack([torch.randn(samples, len(CEM_DIMS), generator=g) for _ in range(horizon)])


def init_distribution(horizon: int, maxnorm: float) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.zeros(horizon, 7)
    std = torch.zeros(horizon, 7)
    std[:, XYZ] = maxnorm
    std[:, GRIPPER] = 1.0
    return mean, std


def sample_actions(mean: torch.Tensor, std: torch.Tensor, noise: torch.Tensor, maxnorm: float) -> torch.Tensor:
    """noise [H, S, 4] -> clipped actions [S, H, 7] with zero rotations."""
    dims = torch.tensor(CEM_DIMS, device=mean.device)
    x = noise.to(mean.device) * std[:, None, dims] + mean[:, None, dims]  # [H, S, 4]
    out = torch.zeros(x.shape[1], x.shape[0], 7, device=mean.device)
    out[..., XYZ] = x[..., :3].clamp(-maxnorm, maxnorm).transpose(0, 1)
    out[..., GRIPPER] = x[..., 3].clamp(-GRIPPER_CLIP, GRIPPER_CLIP).transpose(0, 1)
    return out


def refit(actions: torch.Tensor, energy: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, topk: int,
          momenta: tuple[float, float, float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Momentum update of mean/std [H, 7] towards the top-k (lowest energy) actions [S, H, 7]."""
    m_mean, m_std, m_mean_g, m_std_g = momenta
    idx = torch.topk(energy, topk, largest=False).indices
    top = actions[idx].float()
    new_mean, new_std = top.mean(0), top.std(0)
    wm = torch.full((7,), m_mean, device=mean.device)
    ws = torch.full((7,), m_std, device=mean.device)
    wm[GRIPPER], ws[GRIPPER] = m_mean_g, m_std_g
    return wm * mean + (1 - wm) * new_mean, ws * std + (1 - ws) * new_std


class CemPlanner(node.StatelessNode):
    def phase_init(self, batch: node.Batch) -> node.Batch:
        out = []
        for e in batch:
            if e["horizon"] < 1:
                raise node.RequestError(f"rollout must be >= 1, got {e['horizon']}", "rollout")
            mean, std = init_distribution(e["horizon"], e["maxnorm"])
            out.append({"mean": mean.to(self.spec.device), "std": std.to(self.spec.device)})
        return out

    def phase_sample(self, batch: node.Batch) -> node.Batch:
        out = []
        for e in batch:
            mean, std, samples = e["mean"].float(), e["std"].float(), e["samples"]
            if samples < 2:
                raise node.RequestError(f"samples must be >= 2, got {samples}", "samples")
            noise = cem_noise(e["seed"], e["iteration"], samples, mean.shape[0])
            out.append({"actions": sample_actions(mean, std, noise, e["maxnorm"])})
        return out

    def phase_score(self, batch: node.Batch) -> node.Batch:
        return [{"energy": (e["predicted"].float() - e["goal"][-1:].float()).abs().mean(dim=(1, 2))}
                for e in batch]

    def phase_refit(self, batch: node.Batch) -> node.Batch:
        out = []
        for e in batch:
            energy = e["energy"]
            if not 1 <= e["topk"] <= energy.shape[0]:
                raise node.RequestError(f"topk must be in 1..samples ({energy.shape[0]}), got {e['topk']}", "topk")
            momenta = (e["momentum_mean"], e["momentum_std"], e["momentum_mean_gripper"], e["momentum_std_gripper"])
            mean, std = refit(e["actions"], energy, e["mean"].float(), e["std"].float(), e["topk"], momenta)
            out.append({"mean": mean, "std": std})
        return out

    def phase_first(self, batch: node.Batch) -> node.Batch:
        return [{"action": e["mean"][0]} for e in batch]
