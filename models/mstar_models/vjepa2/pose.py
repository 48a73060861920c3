"""End-effector pose integration, as the official `notebooks/utils/mpc_utils.compute_new_pose`.

A pose is 7-D: xyz, extrinsic "xyz" Euler angles (roll, pitch, yaw; scipy's lowercase
convention, R = Rz(yaw) @ Ry(pitch) @ Rx(roll)), gripper. An action is the same 7-D delta.
The official code (scipy, on the host) does:
    xyz'     = xyz + dxyz
    R'       = R(dtheta) @ R(theta)          (the delta rotates in the world frame)
    theta'   = euler_xyz(R')
    gripper' = clip(gripper + dgripper, 0, 1)
Here the same math is batched torch on the pose's device (no host round trip per step); the
Euler extraction matches scipy's `as_euler("xyz")` away from gimbal lock (pitch = +-pi/2,
where the angles are not unique; we then put all of the remaining rotation in roll).
"""

from __future__ import annotations

import torch


def euler_xyz_to_matrix(theta: torch.Tensor) -> torch.Tensor:
    """[..., 3] extrinsic xyz angles -> [..., 3, 3] rotation matrices (Rz @ Ry @ Rx)."""
    a, b, c = theta.unbind(-1)
    ca, sa, cb, sb, cc, sc = a.cos(), a.sin(), b.cos(), b.sin(), c.cos(), c.sin()
    rows = [
        [cc * cb, cc * sb * sa - sc * ca, cc * sb * ca + sc * sa],
        [sc * cb, sc * sb * sa + cc * ca, sc * sb * ca - cc * sa],
        [-sb, cb * sa, cb * ca],
    ]
    return torch.stack([torch.stack(r, dim=-1) for r in rows], dim=-2)


def matrix_to_euler_xyz(m: torch.Tensor) -> torch.Tensor:
    """[..., 3, 3] -> [..., 3] extrinsic xyz angles; pitch in [-pi/2, pi/2], others in (-pi, pi]."""
    pitch = torch.asin((-m[..., 2, 0]).clamp(-1.0, 1.0))
    cos_pitch = torch.sqrt(m[..., 0, 0] ** 2 + m[..., 1, 0] ** 2)
    locked = cos_pitch < 1e-6
    roll = torch.where(locked, torch.atan2(-m[..., 1, 2], m[..., 1, 1]), torch.atan2(m[..., 2, 1], m[..., 2, 2]))
    yaw = torch.where(locked, torch.zeros_like(pitch), torch.atan2(m[..., 1, 0], m[..., 0, 0]))
    return torch.stack([roll, pitch, yaw], dim=-1)


def compute_new_pose(pose: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """pose, action [..., 7] -> the pose after the action [..., 7] (float64 math, the pose dtype out)."""
    p, a = pose.to(torch.float64), action.to(torch.float64)  # float64: angles survive the round trip
    xyz = p[..., :3] + a[..., :3]
    rot = euler_xyz_to_matrix(a[..., 3:6]) @ euler_xyz_to_matrix(p[..., 3:6])
    theta = matrix_to_euler_xyz(rot)
    gripper = (p[..., 6:] + a[..., 6:]).clamp(0.0, 1.0)
    return torch.cat([xyz, theta, gripper], dim=-1).to(pose.dtype)
