"""The official V-JEPA 2-AC inference loop, recompute-everything, written from the official math.

This is the baseline the KV-cached node is checked and benchmarked against. It follows
`src/models/ac_predictor.py` (`VisionTransformerPredictorAC.forward`), `src/models/utils/
modules.py` (`ACBlock`, `ACRoPEAttention`, `rotate_queries_or_keys`,
`build_action_block_causal_attention_mask`) and `notebooks/utils/` (`WorldModel.step_predictor`,
`mpc_utils.cem`, `compute_new_pose`) in their structure: a dense [B, L] sequence, the action
tokens' q/k/v computed and rotated separately and merged back, a boolean block-causal mask
built for `max_steps` steps and sliced, SDPA; and a rollout that re-runs the whole predictor
over every frame so far at every step. It shares no code with the node except the module
names (so one state dict loads into both) and the CEM's noise stream (`cem_noise`), which
both sides must draw identically for a plan to be comparable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.vjepa2.cem import cem_noise


def rotate_queries_or_keys(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Official RoPE of x [B, heads, N, D] at positions pos [N] (angles tiled, pairs rotated)."""
    d = x.size(-1)
    omega = torch.arange(d // 2, dtype=x.dtype, device=x.device)
    omega /= d / 2.0
    omega = 1.0 / 10000**omega
    freq = pos.to(x.dtype).unsqueeze(-1) * omega
    emb_sin = freq.sin().repeat(1, 1, 1, 2)
    emb_cos = freq.cos().repeat(1, 1, 1, 2)
    y = x.unflatten(-1, (-1, 2))
    y1, y2 = y.unbind(dim=-1)
    y = torch.stack((-y2, y1), dim=-1).flatten(-2)
    return (x * emb_cos) + (y * emb_sin)


def build_action_block_causal_attention_mask(steps: int, h: int, w: int, add_tokens: int) -> torch.Tensor:
    n_t = add_tokens + h * w
    mask = torch.zeros(steps * n_t, steps * n_t, dtype=torch.bool)
    for t1 in range(steps):
        for t2 in range(t1 + 1):
            mask[t1 * n_t : (t1 + 1) * n_t, t2 * n_t : (t2 + 1) * n_t] = True
    return mask


class _ACRoPEAttention(nn.Module):
    def __init__(self, dim: int, heads: int, grid: int):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)
        self.d_dim = self.h_dim = self.w_dim = int(2 * ((self.head_dim // 3) // 2))
        self.grid_size = grid

    def _rotate(self, t: torch.Tensor, d: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        s = 0
        parts = []
        for dims, pos in ((self.d_dim, d), (self.h_dim, h), (self.w_dim, w)):
            parts.append(rotate_queries_or_keys(t[..., s : s + dims], pos=pos))
            s += dims
        return torch.cat(parts + [t[..., s:]], dim=-1)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor, steps: int, h: int, w: int,
                action_tokens: int) -> torch.Tensor:
        b, n, c = x.size()
        ids = torch.arange(steps * h * w, device=x.device)
        d_pos = 1.0 * (ids // (h * w))
        h_pos = 1.0 * ((ids - h * w * (ids // (h * w))) // w) * (self.grid_size / h)
        w_pos = 1.0 * ((ids - h * w * (ids // (h * w))) % w) * (self.grid_size / w)
        x = x.view(b, -1, action_tokens + h * w, c)
        aq, ak, av = [], [], []
        for i in range(action_tokens):
            a = x[:, :, i : i + 1, :].flatten(1, 2)
            q, k, v = self.qkv(a).unflatten(-1, (3, self.num_heads, -1)).permute(2, 0, 3, 1, 4)
            t_pos = torch.arange(steps, device=x.device)
            qd = rotate_queries_or_keys(q[..., : self.d_dim], pos=t_pos)
            kd = rotate_queries_or_keys(k[..., : self.d_dim], pos=t_pos)
            aq.append(torch.cat([qd, q[..., self.d_dim :]], dim=-1).view(b, self.num_heads, steps, 1, -1))
            ak.append(torch.cat([kd, k[..., self.d_dim :]], dim=-1).view(b, self.num_heads, steps, 1, -1))
            av.append(v.view(b, self.num_heads, steps, 1, -1))
        frames = x[:, :, action_tokens:, :].flatten(1, 2)
        q, k, v = self.qkv(frames).unflatten(-1, (3, self.num_heads, -1)).permute(2, 0, 3, 1, 4)
        q, k = self._rotate(q, d_pos, h_pos, w_pos), self._rotate(k, d_pos, h_pos, w_pos)

        def merge(tx: torch.Tensor, tz: list[torch.Tensor]) -> torch.Tensor:
            tx = tx.view(b, -1, steps, h * w, tx.size(-1))
            return torch.cat([torch.cat(tz, dim=3), tx], dim=3).flatten(2, 3)

        q, k, v = merge(q, aq), merge(k, ak), merge(v, av)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _ACBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int, grid: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _ACRoPEAttention(dim, heads, grid)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = _MLP(dim, mlp)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor, steps: int, h: int, w: int, cond: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), attn_mask, steps, h, w, cond)
        return x + self.mlp(self.norm2(x))


class RefACPredictor(nn.Module):
    """`VisionTransformerPredictorAC` at inference (no extrinsics, no dropout, frame-causal)."""

    def __init__(self, enc_dim: int, dim: int, depth: int, heads: int, mlp: int, grid: int, max_steps: int,
                 action_dim: int = 7, extrinsics_dim: int = 6):
        super().__init__()
        self.grid_height = self.grid_width = grid
        self.predictor_embed = nn.Linear(enc_dim, dim)
        self.action_encoder = nn.Linear(action_dim, dim)
        self.state_encoder = nn.Linear(action_dim, dim)
        self.extrinsics_encoder = nn.Linear(extrinsics_dim, dim)
        self.predictor_blocks = nn.ModuleList(_ACBlock(dim, heads, mlp, grid) for _ in range(depth))
        self.predictor_norm = nn.LayerNorm(dim, eps=1e-6)
        self.predictor_proj = nn.Linear(dim, enc_dim)
        self.register_buffer("attn_mask", build_action_block_causal_attention_mask(max_steps, grid, grid, 2),
                             persistent=False)

    def forward(self, x: torch.Tensor, actions: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        x = self.predictor_embed(x)
        b, n_ctxt, d = x.size()
        hw = self.grid_height * self.grid_width
        steps = n_ctxt // hw
        s = self.state_encoder(states).unsqueeze(2)
        a = self.action_encoder(actions).unsqueeze(2)
        x = torch.cat([a, s, x.view(b, steps, hw, d)], dim=2).flatten(1, 2)
        mask = self.attn_mask[: x.size(1), : x.size(1)].to(x.device)
        for blk in self.predictor_blocks:
            x = blk(x, mask, steps, self.grid_height, self.grid_width, 2)
        x = x.view(b, steps, 2 + hw, d)[:, :, 2:, :].flatten(1, 2)
        return self.predictor_proj(self.predictor_norm(x))


def compute_new_pose(pose: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """Official `compute_new_pose` (scipy on the host) for pose/action [B, 1, 7]."""
    try:
        import numpy as np
        from scipy.spatial.transform import Rotation
    except ImportError:  # a machine without scipy: the node's torch version of the same math
        from mstar_models.vjepa2.pose import compute_new_pose as torch_pose

        return torch_pose(pose, action)
    p = pose[:, 0].double().cpu().numpy()
    a = action[:, 0].double().cpu().numpy()
    new_xyz = p[:, :3] + a[:, :3]
    mats = [Rotation.from_euler("xyz", th, degrees=False).as_matrix() for th in p[:, 3:6]]
    deltas = [Rotation.from_euler("xyz", th, degrees=False).as_matrix() for th in a[:, 3:6]]
    angles = np.stack([Rotation.from_matrix(dm @ m).as_euler("xyz", degrees=False)
                       for dm, m in zip(deltas, mats)]) if len(mats) else np.zeros((0, 3))
    new_gripper = np.clip(p[:, -1:] + a[:, -1:], 0, 1)
    new_pose = np.concatenate([new_xyz, angles, new_gripper], axis=-1)
    return torch.from_numpy(new_pose).to(pose.device).to(pose.dtype)[:, None]


def step_predictor(pred: RefACPredictor, reps: torch.Tensor, actions: torch.Tensor, poses: torch.Tensor,
                   normalize_reps: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`WorldModel.step_predictor`: the whole predictor over every frame so far -> the next frame."""
    b, _, n_t, d = reps.size()
    dt = pred.predictor_embed.weight.dtype  # the official runs under autocast: inputs in the compute dtype
    next_rep = pred(reps.flatten(1, 2).to(dt), actions.to(dt), poses.to(dt))[:, -n_t:]
    if normalize_reps:
        next_rep = F.layer_norm(next_rep, (next_rep.size(-1),))
    return next_rep.view(b, 1, n_t, d), compute_new_pose(poses[:, -1:], actions[:, -1:])


@torch.inference_mode()
def rollout(pred: RefACPredictor, context: torch.Tensor, states: torch.Tensor, actions: torch.Tensor,
            horizon: int, normalize_reps: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """context [T, N, D], states [T, 7], actions [B, A, 7] -> predicted frames [B, horizon, N, D]
    and poses [B, horizon, 7], recomputing all T + h blocks at every step h."""
    b, steps = actions.shape[0], context.shape[0]
    frames = context[None].expand(b, -1, -1, -1)
    poses = states[None].expand(b, -1, -1).float()
    for h in range(horizon):
        nxt, pose = step_predictor(pred, frames, actions[:, : steps + h], poses, normalize_reps)
        frames = torch.cat([frames, nxt.to(frames.dtype)], dim=1)
        poses = torch.cat([poses, pose.float()], dim=1)
    return frames[:, steps:], poses[:, steps:]


@torch.inference_mode()
def cem(pred: RefACPredictor, context_frame: torch.Tensor, context_pose: torch.Tensor, goal_frame: torch.Tensor,
        *, rollout: int, samples: int, topk: int, cem_steps: int, momentum_mean: float, momentum_std: float,
        momentum_mean_gripper: float, momentum_std_gripper: float, maxnorm: float, seed: int = 0,
        normalize_reps: bool = True) -> torch.Tensor:
    """`mpc_utils.cem` with `step_predictor` as the world model. context_frame / goal_frame
    [1, N, D], context_pose [1, 7] -> the refined mean trajectory [rollout, 7]."""
    dev = context_frame.device
    ctx = context_frame[None].repeat(samples, 1, 1, 1)  # [S, 1, N, D]
    goal = goal_frame.repeat(samples, 1, 1)
    pose0 = context_pose[None].repeat(samples, 1, 1).float()  # [S, 1, 7]
    mean = torch.zeros(rollout, 4, device=dev)
    std = torch.cat([torch.ones(rollout, 3, device=dev) * maxnorm, torch.ones(rollout, 1, device=dev)], dim=-1)
    for step in range(cem_steps):
        noise = cem_noise(seed, step, samples, rollout).to(dev)
        action_traj, frame_traj, pose_traj = None, ctx, pose0
        for h in range(rollout):
            a = noise[h] * std[h] + mean[h]
            a[:, :3] = torch.clip(a[:, :3], min=-maxnorm, max=maxnorm)
            a[:, -1:] = torch.clip(a[:, -1:], min=-0.75, max=0.75)
            a = torch.cat([a[:, :3], torch.zeros(samples, 3, device=dev), a[:, -1:]], dim=-1)[:, None]
            action_traj = a if action_traj is None else torch.cat([action_traj, a], dim=1)
            nxt, pose = step_predictor(pred, frame_traj, action_traj, pose_traj, normalize_reps)
            frame_traj = torch.cat([frame_traj, nxt.to(frame_traj.dtype)], dim=1)
            pose_traj = torch.cat([pose_traj, pose.float()], dim=1)
        loss = (frame_traj[:, -1].float() - goal.float()).abs().mean(dim=(1, 2))
        top = action_traj[torch.topk(loss, topk, largest=False).indices]
        sel_mean, sel_std = top.mean(dim=0), top.std(dim=0)
        mean = torch.cat([momentum_mean * mean[:, :3] + (1 - momentum_mean) * sel_mean[:, :3],
                          momentum_mean_gripper * mean[:, 3:] + (1 - momentum_mean_gripper) * sel_mean[:, -1:]],
                         dim=-1)
        std = torch.cat([momentum_std * std[:, :3] + (1 - momentum_std) * sel_std[:, :3],
                         momentum_std_gripper * std[:, 3:] + (1 - momentum_std_gripper) * sel_std[:, -1:]],
                        dim=-1)
    return torch.cat([mean[:, :3], torch.zeros(rollout, 3, device=dev), mean[:, -1:]], dim=-1)
