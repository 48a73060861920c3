"""A chained cohort's links on one worker: each call's columns, stepped in body order.

A loop whose body is several kv calls (the mark's `links`, docs/plan-format.md "Cohort
loops": chains; Qwen3-Omni's thinker step and talker frame) runs as one cohort whose rows
are aligned across one `CohortColumns` per call (engine/cohort_engine.py; the conductor's
half, control/cohort.py, joins, moves and leaves a row on every link together). One chained
step runs each link's column step in body order (each eager, or its own CUDA graph per
bucket); a link's `chained` input is an earlier link's output of the same step, which that
link leaves in a device buffer (`CohortColumns.exports`) and the later one reads in place:
nothing goes through the host.

The generic loop runs a wasted (speculative) iteration's first call only (it reads the
previous iteration's flag once that call is back), so a step launched before the previous
step's flag is read keeps the later links' node columns of the rows that flag stopped as
they were: `stopped` (a device column, the flag's port of the last step, or the prefill's
flag for a row's first step) is each later link's `CohortColumns.hold`, the rows whose node
columns its step puts back, inside the step (so inside its CUDA graph: no launch outside it,
no host wait; docs/runtime.md, "Decode cohorts": chains, says what it costs). `stopped` is
written only after the last link's step, so every later link reads the last step's flag.
Their outputs are never applied and their K/V past the valid steps is truncated by the
conductor, so those rows leave the later links where the generic path leaves them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mstar_runtime.engine.cohort_engine import CohortColumns, CohortResult
from mstar_runtime.kv.block_table import pinned


@dataclass
class ChainResult:
    """A chained step's outputs: each link's `CohortResult`, its ports prefixed as the
    conductor names them ("k." for link k); `arrays()` as `CohortResult.arrays()`."""

    n: int
    parts: list[tuple[str, CohortResult]]
    index: int = 0  # the cohort's step index (set by the conductor's Cohort)

    def arrays(self) -> dict[str, np.ndarray]:
        return {prefix + key: a for prefix, part in self.parts for key, a in part.arrays().items()}


class ChainColumns:
    """The links of one chained cohort (module docstring). `imports`: (link, input port,
    earlier link, its output port) per chained input; `flag`: the (link, output port) of the
    loop's `until`, or None (a fixed loop: no row ever stops on a flag)."""

    def __init__(self, links: Sequence[CohortColumns], prefixes: Sequence[str],
                 imports: Sequence[tuple[int, str, int, str]], flag: tuple[int, str] | None):
        self.links, self.prefixes = list(links), list(prefixes)
        for k, port, at, out_port in imports:
            self.links[at].export_ports.add(out_port)
            self.links[k].imports[port] = (self.links[at], out_port)
        self.flag = flag
        if flag is not None:
            self.links[flag[0]].export_ports.add(flag[1])
        first = self.links[0]
        self.stopped = torch.zeros(first.rows, dtype=torch.bool, device=first.device)
        if flag is not None:  # a fixed loop stops no row on a flag: its later links hold nothing
            for link in self.links[1:]:
                link.hold = self.stopped

    def join(self, first: int, stops: Sequence[bool | torch.Tensor]) -> None:
        """Rows `first`, ... joined every link: whether each one's flag (its prefill's) already
        said stop, a host bool or a device tensor whose first element says it (copied where
        it is, never read: the conductor reads it once the row's first step is launched)."""
        end = first + len(stops)
        on_device = [(i, s) for i, s in enumerate(stops) if isinstance(s, torch.Tensor) and s.numel()]
        host = [not isinstance(s, torch.Tensor) and bool(s) for s in stops]  # an empty tensor says no stop
        self.stopped[first:end].copy_(pinned(np.array(host, dtype=np.bool_)), non_blocking=True)
        with torch.inference_mode():
            for i, s in on_device:  # after the upload above, in stream order
                self.stopped[first + i].copy_(s.reshape(-1)[0], non_blocking=True)

    def move(self, src: int, dst: int) -> None:
        self.stopped[dst] = self.stopped[src]

    def step(self, n: int, run: Callable[[int], CohortResult] | None = None) -> ChainResult:
        """One chained step of rows 0..n-1; `run(k)` steps link k (default: its `step(n)`; the
        worker's own entry point, so that each link's steps are counted as a cohort's)."""
        parts = [(prefix, run(k) if run is not None else link.step(n))
                 for k, (link, prefix) in enumerate(zip(self.links, self.prefixes, strict=True))]
        if self.flag is not None:
            at, port = self.flag
            with torch.inference_mode():
                self.stopped[:n].copy_(self.links[at].exports[port][:n].reshape(n).bool())
        return ChainResult(n, parts)


__all__ = ["ChainColumns", "ChainResult"]
