"""Sampling as one runtime stage: a request's settings, read once, held as device columns.

A node computes logits and what its model adds to them (a mask of allowed ids, a repetition
penalty over its history); the stage turns them into one token per row:

- `params`:  `SamplingParams` and `read_sampling`, the one reader of the `temperature`,
             `top_k`, `top_p`, `repetition_penalty`, `seed` and token-limit ports
             (`SamplingPorts` says which of them a node has; every node that samples
             declares one);
- `columns`: the rows' settings as device columns (`sampling_row` at a cohort's join,
             `columns_of` for a one-off call);
- `stage`:   `sample_columns(logits, cols)`, the whole-batch, capturable stage, and
             `sample(logits, params, histories, steps)` for per-row Python settings;
             `sample_torch`, the same stage in torch ops on every device;
- `fused`:   top-k, top-p and the draw as Triton kernels without a sort: the stage's path on a
             GPU with Triton (the torch ops' tokens up to rounding at a boundary);
- `seeds`:   the draw's only randomness, `uniform(seed, step)`, on the host and on tensors.

Qwen3-Omni's code predictor draws over its own top-50 prefix with `pick_from_cdf` (its
module says why not through `sample_columns`).
"""

from mstar_runtime.sampling.columns import SamplingColumns, columns_of, sampling_row
from mstar_runtime.sampling.params import REQUIRED, SamplingParams, SamplingPorts, read_sampling
from mstar_runtime.sampling.seeds import derive_seed, signed64, uniform, uniforms
from mstar_runtime.sampling.stage import pick_from_cdf, process_logits, sample, sample_columns, sample_torch

__all__ = [
    "REQUIRED", "SamplingColumns", "SamplingParams", "SamplingPorts", "columns_of", "derive_seed", "pick_from_cdf",
    "process_logits", "read_sampling", "sample", "sample_columns", "sample_torch", "sampling_row", "signed64", "uniform",
    "uniforms",
]
