"""How a mode of `mstar-run` builds its engine (`EngineOptions`, `start_engine`).

Its own module so that the CLI (cli.py) and the engine process it starts (engine_process.py)
both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from os import PathLike

import torch

from mstar_runtime.api import MStar
from mstar_runtime.plan.loader import Plan


@dataclass(frozen=True)
class EngineOptions:
    """How a mode builds its engine: `mstar-run`'s --weights, --device, --threads,
    --request-timeout, --prefix-caching, --prefix-chunk, --window-gather (and the hidden
    --preempt-every, a debug aid)."""

    weights: str | PathLike[str] = "dummy"
    device: str | None = None  # default: what the plan was compiled for
    threads: int | None = None  # torch CPU threads
    request_timeout: float | None = None
    preempt_every: int | None = None
    prefix_caching: bool = False
    prefix_chunk: int | None = None  # with prefix_caching; None: DEFAULT_PREFIX_CHUNK
    window_gather: int = 0  # steps a codec window may wait for others (docs/runtime.md, "Window gather")


def start_engine(plan: Plan, options: EngineOptions) -> MStar:
    """An engine running `plan` (workers started, weights loaded)."""
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    return MStar.from_plan(plan, weights=str(options.weights), preempt_every=options.preempt_every,
                           request_timeout=options.request_timeout, prefix_caching=options.prefix_caching,
                           prefix_chunk=options.prefix_chunk, window_gather=options.window_gather)
