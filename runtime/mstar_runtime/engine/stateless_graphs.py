"""CUDA graphs for stateless steps (a codec's fixed-window decode): pad to a bucket, capture, replay.

The `cuda-graphs` pass lists the (node, phase, rank) steps it captures with their batch
buckets; for a stateless node (Orpheus' `snac.decode`) the `StatelessEngine` owns one
`StatelessGraphRunner` per such phase, if the node offers the phase for capture.

The node-side contract. A stateless node opts a phase in with `graph_phase(phase) ->
GraphPhase | None`, which splits the phase in three:
- `prepare(batch) -> Prepared`: the host side. It validates the entries (a `RequestError`
  fails the request) and builds the inputs: one tensor per input, first dim = one row per
  entry, the other dims fixed. It should not wait for the device: host data stays on the
  host (the runner copies it into its static buffers with non-blocking copies from pinned
  memory), device data is left where it is. A check that needs device values (a code range
  of device-resident codes) is returned as `Prepared.check`, called once the step's work
  is queued, so the GPU has that work to do while the host waits for the check's values.
- `fn(*inputs) -> tensor | tuple of tensors`: pure tensor code on the phase's device, the
  same kernels every call for one batch size: no host reads, no Python branches on data,
  no state it writes. Row i of every output depends on row i of the inputs only (that is
  what makes padding legal), and it must accept any row values `prepare` can produce, even
  ones a later `check` rejects (clamp indices: a replay cannot raise, and an out-of-range
  gather on a GPU kills the process' CUDA context).
- `finish(batch, outputs) -> Batch`: the per-entry output dicts, from `n`-row outputs.
`run_phase(gp, batch)` is the phase: prepare, fn on the device (eagerly, or through a
runner), check, finish. A node's own `phase_<name>` calls it without a runner, so the eager
and the graphed path share everything but the call of `fn`.

What a runner does per step (`StatelessGraphRunner.run`):
1. picks the smallest bucket B >= n entries (more entries than the largest bucket, or a
   runner whose capture failed, run `fn` eagerly);
2. on the runner's first step, captures `fn` for every bucket, largest first, on static
   input buffers holding zeros: two warm-up runs on a side stream (lazy inits such as
   cuDNN's algorithm choice must not happen in the capture), then `torch.cuda.graph` into a
   memory pool shared by all the runner's buckets (a capture synchronises the device: done
   once up front, it never stalls a pipeline that is already running);
3. copies the n real rows into the bucket's static input buffers (non-blocking) and zeroes
   rows n..B-1 (pad rows: zeros are a valid input for the contract above, and stale rows
   of an earlier, larger step would be too, but zeros keep every replay reproducible);
4. replays, and returns the outputs' first n rows *cloned*: the graph's outputs are static
   tensors that the next replay of the bucket overwrites, and the clones are what the
   caller may keep (`graphs.first_rows`, which the KV runner uses too).
All buckets share one graph pool. That is safe in any capture and replay order because the
runner keeps every graph's static outputs alive (no later capture is handed their memory),
replays run one at a time on one stream, and each replay's outputs are cloned before the
next replay. Captures use `capture_error_mode="thread_local"`: the server thread may read
earlier outputs (`.cpu()`) while the engine thread captures.

The side stream (`side_stream=True`, the default on a GPU). Replays, with their input copies
and output clones, run on a stream of the runner's own, S, instead of the caller's current
stream M, so the GPU can run them beside work queued on M. The ordering argument:
- inputs: when an input is a device tensor (made on M), S first waits for everything
  queued on M so far (`S.wait_stream(M)`: an event recorded on M, waited on by S). When
  every input comes from the host (pinned memory), S waits for nothing on M, and the
  replay overlaps the work already queued there (e.g. the LLM decode step).
- static buffers and graph memory are only ever touched on S (copies, replays, clones;
  a capture synchronises the device), so replays are ordered among themselves.
- outputs: the clones are made on S; before `run` returns, M waits for S
  (`M.wait_stream(S)`), so whatever the caller then queues on M (or reads on the host
  through M) sees finished outputs.
- allocator: a tensor used on a stream other than the one it was allocated on is marked
  with `record_stream`: the clones (allocated on S, used on M) and the device inputs
  (allocated on M, read on S), so the caching allocator reuses their blocks only once that
  stream's work on them is done.
So a replay overlaps work queued on M before the step only when its inputs come from the
host; with device inputs it is ordered after that work, as on M. Work queued on M after
the step always waits for the replay (the outputs could be deferred further only with a
hook at their first use, which the engine does not have).

`capture=False` runs the same bucketing, static buffers, padding and slicing with `fn`
called eagerly on the padded buffers (`eager_capture`), and a test may pass its own
`Capture` (a fake graph): the CPU tests check the bookkeeping that way
(tests/test_stateless_graphs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mstar_runtime.engine.graphs import first_rows, smallest_bucket
from mstar_runtime.ops.node import Batch, NodeError
from mstar_runtime.ops.readback import pinned, upload_tensor

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # before each capture, on a side stream (as torch requires)

Outputs = Any  # a tensor or a tuple of tensors, first dim = rows
Replay = Callable[[], Outputs]
"""Runs a captured `fn` again on its static inputs and returns its (static) outputs."""


class Capture(Protocol):
    """Makes the replay of `fn` on a bucket's static input buffers (called once per bucket)."""

    def __call__(self, fn: Callable[..., Outputs], inputs: Sequence[torch.Tensor]) -> Replay: ...


@dataclass(frozen=True)
class Prepared:
    """What `GraphPhase.prepare` built for a batch (see the module docstring)."""

    inputs: tuple[torch.Tensor, ...]  # one row per entry; on the host or on the phase's device
    check: Callable[[], None] | None = None  # deferred validation, after the work is queued


@dataclass(frozen=True)
class GraphPhase:
    """A stateless phase split into host preparation, a capturable tensor function and output dicts."""

    device: torch.device
    prepare: Callable[[Batch], Prepared]
    fn: Callable[..., Outputs]
    finish: Callable[[Batch, Outputs], Batch]


def run_phase(gp: GraphPhase, batch: Batch, runner: StatelessGraphRunner | None = None) -> Batch:
    """The phase: prepare, `fn` (through `runner` when it takes the batch), check, finish."""
    if not batch:
        return []
    prepared = gp.prepare(batch)
    if runner is not None and runner.accepts(len(batch)):
        outputs = runner.run(gp.fn, prepared.inputs)
    else:
        outputs = gp.fn(*(upload_tensor(t, gp.device) for t in prepared.inputs))
    if prepared.check is not None:
        prepared.check()
    return gp.finish(batch, outputs)


# ------------------------------------------------------------------------------ captures
def eager_capture(fn: Callable[..., Outputs], inputs: Sequence[torch.Tensor]) -> Replay:
    """No graph: every "replay" calls `fn` on the static buffers (`capture=False`, any device)."""
    return lambda: fn(*inputs)


class CudaGraphCapture:
    """CUDA graphs of one runner, all in one memory pool (see the module docstring)."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a cuda device, got {device}; use capture=False elsewhere")
        self.device = device
        self._pool: Any = None
        self.graphs: list[Any] = []  # torch.cuda.CUDAGraph, kept alive with ...
        self.outputs: list[Outputs] = []  # ... their static outputs (tests poison them before a replay)

    def __call__(self, fn: Callable[..., Outputs], inputs: Sequence[torch.Tensor]) -> Replay:
        current = torch.cuda.current_stream(self.device)
        warm = torch.cuda.Stream(device=self.device)
        warm.wait_stream(current)
        with torch.cuda.stream(warm):
            for _ in range(WARMUP_RUNS):
                fn(*inputs)
        current.wait_stream(warm)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = fn(*inputs)
        self.graphs.append(graph)
        self.outputs.append(outputs)

        def replay() -> Outputs:
            graph.replay()
            return outputs

        return replay


# -------------------------------------------------------------------------------- runner
@dataclass
class _Bucket:
    size: int
    inputs: list[torch.Tensor]  # static: [size, *row shape] per input
    replay: Replay | None = None


@dataclass(frozen=True)
class _Row:
    """The fixed per-row shape and dtype of one input."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class StatelessGraphRunner:
    """Pads, captures and replays one stateless phase per batch bucket (module docstring)."""

    phase: GraphPhase
    buckets: Sequence[int]
    capture: Capture
    side_stream: bool = False
    name: str = ""
    replays: int = 0  # steps served through the buckets (for stats and tests)
    captures: int = 0
    failed: str | None = None  # why a capture failed; the runner then declines every step
    _state: dict[int, _Bucket] = field(default_factory=dict)
    _rows: list[_Row] | None = None
    _side: Any = None  # the side stream, made on first use

    def __post_init__(self) -> None:
        if not self.buckets or min(self.buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {list(self.buckets)}")
        self.buckets = sorted(set(int(b) for b in self.buckets))
        if self.side_stream and self.phase.device.type != "cuda":
            raise ValueError(f"a side stream needs a cuda device, got {self.phase.device}")

    @property
    def max_bucket(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def accepts(self, n: int) -> bool:
        return self.failed is None and self.bucket_for(n) is not None

    def run_phase(self, batch: Batch) -> Batch:
        return run_phase(self.phase, batch, self)

    # ------------------------------------------------------------------ the step
    def run(self, fn: Callable[..., Outputs], inputs: Sequence[torch.Tensor]) -> Outputs:
        """`fn(*inputs)` for n <= max_bucket rows, through the bucket's graph; n-row outputs, fresh tensors."""
        n = self._check_inputs(inputs)
        bucket = self.bucket_for(n)
        if bucket is None or self.failed is not None:
            raise ValueError(f"node '{self.name}': the runner does not take {n} rows (accepts() first)")
        if not self.side_stream:
            return self._step(fn, inputs, n, bucket)
        main = torch.cuda.current_stream(self.phase.device)
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.phase.device)
        side = self._side
        on_device = [t for t in inputs if t.device.type != "cpu"]
        if on_device or bucket not in self._state:
            # device inputs were made on M: wait for them (and for what M had queued). A new
            # bucket waits too (once), so that its capture sees the weights M uploaded.
            side.wait_stream(main)
        with torch.cuda.stream(side):
            out = self._step(fn, inputs, n, bucket)  # a failed capture answers eagerly, on S all the same
        for t in on_device:
            t.record_stream(side)
        for t in _tensors(out):
            t.record_stream(main)
        main.wait_stream(side)  # before the caller uses the outputs on M
        return out

    def _step(self, fn: Callable[..., Outputs], inputs: Sequence[torch.Tensor], n: int, bucket: int) -> Outputs:
        if not self._state:
            # the first step captures every bucket, largest first (as the KV runner does): a
            # capture synchronises the device, and a later one would stall a running pipeline
            for size in reversed(self.buckets):
                if self._bucket(size, fn) is None:
                    break
        b = self._bucket(bucket, fn) if self.failed is None else None
        if b is None:  # a capture failed: this step answers eagerly, the runner declines the next
            return fn(*(upload_tensor(t, self.phase.device) for t in inputs))
        for buf, t in zip(b.inputs, inputs, strict=True):
            src = pinned(t) if t.device.type == "cpu" and buf.device.type == "cuda" else t
            buf[:n].copy_(src, non_blocking=True)
            if n < bucket:
                buf[n:].zero_()
        self.replays += 1
        return first_rows(b.replay(), bucket, n, self.name, "a graphed output")

    def _bucket(self, size: int, fn: Callable[..., Outputs]) -> _Bucket | None:
        """The bucket's static buffers (zeros: a valid input) and graph, captured if new; None
        when the capture fails (then `failed` says why and no bucket is kept)."""
        b = self._state.get(size)
        if b is None:
            b = self._state[size] = _Bucket(size, [
                torch.zeros((size, *r.shape), dtype=r.dtype, device=self.phase.device) for r in self._rows or ()
            ])
        if b.replay is None:
            try:
                b.replay = self.capture(fn, b.inputs)
            except Exception as e:  # noqa: BLE001 - a graph that cannot be captured must not fail serving
                self.failed = f"{type(e).__name__}: {e}"
                self._state.clear()
                log.warning("node '%s': CUDA-graph capture failed (%s); its steps run eagerly",
                            self.name, self.failed)
                return None
            self.captures += 1
        return b

    def _check_inputs(self, inputs: Sequence[torch.Tensor]) -> int:
        """Rows of the step; every input has one row per entry and the row shape of the first step."""
        if not inputs or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in inputs):
            got = [type(t).__name__ if not isinstance(t, torch.Tensor) else tuple(t.shape) for t in inputs]
            raise NodeError(f"node '{self.name}': graphed inputs must be tensors with a row dim, got {got}")
        n = inputs[0].shape[0]
        if any(t.shape[0] != n for t in inputs):
            raise NodeError(f"node '{self.name}': graphed inputs must have one row per entry, got "
                            f"{[tuple(t.shape) for t in inputs]}")
        rows = [_Row(tuple(t.shape[1:]), t.dtype) for t in inputs]
        if self._rows is None:
            self._rows = rows
        elif rows != self._rows:
            raise NodeError(f"node '{self.name}': graphed inputs changed shape or dtype since the first step "
                            f"({self._rows} -> {rows})")
        return n


def _tensors(outputs: Outputs) -> list[torch.Tensor]:
    return list(outputs) if isinstance(outputs, tuple) else [outputs]


# ---------------------------------------------------------------------------- wiring
def stateless_graph_runners(
    node: Any,
    phases: Mapping[str, Sequence[int]],
    *,
    capture: bool | Capture | None = None,
    side_stream: bool | None = None,
    name: str = "",
) -> dict[str, StatelessGraphRunner]:
    """One runner per phase the plan captures and the node offers (`graph_phase`).

    `capture`: None captures CUDA graphs on a cuda device; False keeps the bookkeeping with
    eager calls (any device); a callable is used as the `Capture` (tests). `side_stream`:
    None means on when capturing CUDA graphs."""
    out: dict[str, StatelessGraphRunner] = {}
    offer = getattr(node, "graph_phase", None)
    for phase, buckets in phases.items():
        gp = offer(phase) if offer is not None else None
        if gp is None:
            log.info("node '%s' phase '%s': no graph_phase contract; its steps run eagerly", name, phase)
            continue
        cuda = gp.device.type == "cuda"
        if capture is None:
            cap: Capture = CudaGraphCapture(gp.device) if cuda else eager_capture
            graphs = cuda
        elif capture is True:
            cap, graphs = CudaGraphCapture(gp.device), True
        elif capture is False:
            cap, graphs = eager_capture, False
        else:
            cap, graphs = capture, False
        side = (graphs if side_stream is None else side_stream) and cuda
        out[phase] = StatelessGraphRunner(gp, buckets, cap, side_stream=side, name=name)
    return out
