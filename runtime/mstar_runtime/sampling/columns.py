"""The per-row sampling settings as device columns: what the stage (`stage.sample`) reads.

A decode cohort makes a row's columns once, at join (`sampling_row`, host tensors it uploads
without a wait), and keeps them on the device across steps (ops/cohort.py); a one-off call
(a prefill's first token) builds them for its batch with `columns_of` (a few uploads). Either
way every stage runs for every row and a step is fixed tensor code: capturable, no host read.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from mstar_runtime.ops.readback import upload, upload_tensor
from mstar_runtime.sampling.params import SamplingParams
from mstar_runtime.sampling.seeds import signed64


@dataclass(frozen=True)
class SamplingColumns:
    """The sampling settings of n rows as tensors on the logits' device."""

    temperature: torch.Tensor  # f32 [n]; 1 where greedy
    top_k: torch.Tensor  # i64 [n]; 0 where greedy; k <= 0 or k >= vocab: off
    top_p: torch.Tensor  # f32 [n]; 1 where greedy
    penalty: torch.Tensor  # f32 [n]
    greedy: torch.Tensor  # bool [n]
    seed: torch.Tensor  # i64 [n], the seed's bits
    step: torch.Tensor  # i64 [n]
    history: torch.Tensor | None  # i64 [n, L], -1 = no token; None: no row has a penalty

    @classmethod
    def from_cohort(cls, cols: Mapping[str, torch.Tensor], step: torch.Tensor | None = None,
                    history: torch.Tensor | None = None) -> SamplingColumns:
        """The columns of a decode cohort whose rows `sampling_row` gave at join: its `step`
        column unless the node passes its own, and `history` (None: no repetition penalty)."""
        return cls(temperature=cols["temperature"], top_k=cols["top_k"], top_p=cols["top_p"],
                   penalty=cols["penalty"], greedy=cols["greedy"], seed=cols["seed"],
                   step=cols["step"] if step is None else step, history=history)


def _row_values(params: SamplingParams) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) as the columns hold them: a greedy row has them off."""
    if params.greedy:
        return 1.0, 0, 1.0
    return params.temperature, params.top_k, params.top_p


def sampling_row(params: SamplingParams, step: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One request's `SamplingColumns` row (no history), as host tensors by default: the
    cohort uploads a joining row without waiting for the device."""
    seed = secrets.randbits(64) if params.seed is None else params.seed
    temperature, top_k, top_p = _row_values(params)
    f = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
    i = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return {"temperature": f(temperature), "top_k": i(top_k), "top_p": f(top_p),
            "penalty": f(params.repetition_penalty), "greedy": torch.tensor(params.greedy, device=device),
            "seed": i(signed64(seed)), "step": i(signed64(step))}


def columns_of(
    params: Sequence[SamplingParams],
    histories: Sequence[torch.Tensor | None],
    steps: Sequence[int],
    device: torch.device | str,
) -> SamplingColumns:
    """The columns of a batch of rows for one call: three uploads (four with histories)."""
    dev = torch.device(device)
    n = len(params)
    if len(histories) != n or len(steps) != n:
        raise ValueError(f"need one history and one step per row, got {len(histories)} and "
                         f"{len(steps)} for {n} rows")
    rows = [_row_values(p) for p in params]
    seeds = [signed64(secrets.randbits(64) if p.seed is None else p.seed) for p in params]
    ints = upload([r[1] for r in rows] + seeds + [signed64(s) for s in steps], torch.int64, dev)
    floats = upload([r[0] for r in rows] + [r[2] for r in rows] + [p.repetition_penalty for p in params],
                    torch.float32, dev)
    penalised = [b for b, p in enumerate(params) if p.repetition_penalty != 1.0]
    return SamplingColumns(
        temperature=floats[:n], top_p=floats[n : 2 * n], penalty=floats[2 * n :],
        greedy=upload([p.greedy for p in params], torch.bool, dev),
        top_k=ints[:n], seed=ints[n : 2 * n], step=ints[2 * n :],
        history=pad_histories(histories, penalised, n, dev),
    )


def pad_histories(
    histories: Sequence[torch.Tensor | None], rows: list[int], n: int, device: torch.device
) -> torch.Tensor | None:
    """The histories of `rows` as one [n, L] int64 tensor padded with -1 (other rows all -1).

    Lengths are host metadata, so no device read is needed. Histories already on the device
    (a node that keeps them there) are joined there with one cat and one gather, whatever the
    batch size; host histories are padded on the host and uploaded once."""
    hs = {b: histories[b].reshape(-1) for b in rows if histories[b] is not None and histories[b].numel()}
    if not hs:
        return None
    width = max(h.numel() for h in hs.values())
    if all(h.device.type == "cpu" for h in hs.values()):
        padded = torch.full((n, width), -1, dtype=torch.int64)
        for b, h in hs.items():
            padded[b, : h.numel()] = h
        return upload_tensor(padded, device)
    return join_histories(hs, n, width, device)


def join_histories(hs: dict[int, torch.Tensor], n: int, width: int, device: torch.device) -> torch.Tensor:
    """Device-side padding: one cat, then a gather at host-computed offsets (no per-row kernels)."""
    flat = torch.cat([h.to(device=device, dtype=torch.int64) for h in hs.values()])
    starts, lens, at = [0] * n, [0] * n, 0
    for b, h in hs.items():
        starts[b], lens[b] = at, h.numel()
        at += h.numel()
    meta = upload(starts + lens, torch.int64, device)
    pos = torch.arange(width, device=device)[None, :]
    src = (meta[:n, None] + pos).clamp_(max=flat.numel() - 1)
    return torch.where(pos < meta[n:, None], flat[src], -1)
