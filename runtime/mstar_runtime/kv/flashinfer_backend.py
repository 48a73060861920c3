"""FlashInfer paged attention for the KVCacheEngine on a GPU, and the choice of backend.

`select_backend(device)` gives a worker its attention backend: a `FlashInferBackend` when
the device is cuda and `flashinfer` imports, else the CPU reference
`attention.paged_attention` (which also runs on a GPU, slowly). The choice is logged once.
`MSTAR_ATTENTION=reference` forces the reference (A/B runs, debugging).

`FlashInferBackend` implements the engine's backend protocol (see `engines.py`):
- `prepare(pool, meta)`, once per step before the node runs: builds the step's host arrays
  once (kv indptr / indices / last_page_len, plus qo_indptr for prefill) into ONE pinned
  int32 tensor -- FlashInfer's `plan()` then copies them to the device with non_blocking
  copies and reads the lengths on the host, so planning never waits for the GPU -- and
  plans one wrapper for every layer of the step:
  - every entry a 1-token step: `BatchDecodeWithPagedKVCacheWrapper` with
    `use_tensor_cores=True` (1.5x faster for GQA at batch 64 on the H200, device.md 3);
  - otherwise `BatchPrefillWithPagedKVCacheWrapper`, causal when every multi-token entry is
    causal, non-causal when every one is "full" (a single query at the end of its context
    sees the whole context under any mask kind, so decode entries never decide);
  - a block-causal entry whose queries all lie in its last block sees every key: it counts
    as "full" (a V-JEPA rollout step appends exactly one frame block);
  - a batch with other `block_causal` entries, or mixing causal and full ones, plans the same
    prefill wrapper with a custom mask (each entry's `attention.attention_mask`, bit-packed
    by FlashInfer): one kernel for the whole mixed batch instead of a split. FlashInfer's
    mask packing reads lengths back from the device, so such steps take a host sync; they
    are prefill-like steps (V-JEPA frames, BAGEL image blocks), never the decode loop.
  If planning fails (an unsupported shape, a kernel that will not build), the step falls
  back to the reference and the reason is logged once.
- `__call__(q, pool, layer, meta, scale)`: runs the planned wrapper on `pool.data[layer]`,
  which is already FlashInfer's NHD paged layout ([pages, 2, page_size, kv_heads, dim]).
  The query head count and the softmax scale are only known here, so the first step of a
  pool plans at its first layer; later steps plan in `prepare` with what was learnt.

Pools FlashInfer cannot serve (float32, a head_dim outside 64/128/256) use the reference.

The prefill wrapper runs FlashInfer's FA2 backend by default: it is the same compiled module
as tensor-core decode and as custom-mask prefill, so a fresh machine compiles one module
(28 s) instead of two (FA3 prefill alone takes 84 s, device.md 2c); prompts of a TTS model
are short enough that FA3's prefill speed does not show. Pass `prefill_backend="auto"` for FA3.
A step of at least `LONG_PREFILL_TOKENS` queries without a custom mask (BAGEL's 4098-token
image blocks and denoise queries, three CFG branches at a time) runs on a second wrapper
with `long_prefill_backend`, by default "auto" (FA3 on Hopper: about twice FA2's speed
there); `$MSTAR_LONG_PREFILL_BACKEND` overrides it ("fa2" keeps one module).

`graph_decoder(pool, scale)` gives the GraphRunner its per-bucket attention:
`FlashInferGraphDecode`, a decode wrapper made with `use_cuda_graph=True` and fixed
indptr / indices / last_page_len buffers, planned before every replay and run inside it.
`graph_prefill(backend, pool, scale, tokens)` does the same for a runner whose entries each
add `tokens` > 1 tokens over their whole context (the V-JEPA rollout step):
`FlashInferGraphPrefill`, a prefill wrapper made with `use_cuda_graph=True` and fixed
qo_indptr / kv indptr / indices / last_page_len buffers (the qo_indptr never changes: every
entry of a bucket, pad entries included, has `tokens` queries), planned non-causal.

`FlashInferRowPrefill` attends query blocks over arbitrary token lists of a pool (a V-JEPA
CEM step: each trajectory's block sees the shared history and its own earlier blocks, which
are interleaved with the other trajectories' and not page-aligned). It views one layer of the
pool as pages of ONE token (`token_views`: K of slot (page p, offset o) is view row
p * 2 * page_size + o, V the same row of a view shifted by page_size rows, both with equal
strides), so any token list is a page table (`token_view_index`), and plans one non-causal
prefill per step with one entry per row: 258 queries over a few thousand keys each, where the
whole step as one block-causal entry would need a q x kv custom mask whose 32-bit offsets
overflow (BENCHMARKS.md: "negative dimension").

Every wrapper here waits, before re-planning, for its previous plan's upload (a
`_PlanFence` event; the backend's own decode and prefill wrappers too, which prefix caching's
chunks plan once per chunk within one step): FlashInfer's plan writes its schedule into one pinned host buffer per
wrapper and queues a copy of it, so a host that runs a step ahead of the GPU must not
overwrite that buffer before the queued copy has read it. The wait is an event query in
steady state (the copy has long run); it blocks only when the host is a whole step ahead.

Nothing here imports flashinfer at module import: only constructing a `FlashInferBackend`
does, so the CPU runtime never needs it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mstar_runtime.kv.attention import (
    AttentionMetadata,
    KVPool,
    SequenceAttention,
    attention_mask,
    paged_attention,
)
from mstar_runtime.kv.block_table import pinned

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 256 << 20  # the float workspace device.md ran with; shared by every wrapper
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
ENV_VAR = "MSTAR_ATTENTION"  # "reference" forces the reference; "flashinfer" makes a failed import an error
LONG_PREFILL_ENV = "MSTAR_LONG_PREFILL_BACKEND"  # the long-prefill wrapper's backend (module docstring)
LONG_PREFILL_TOKENS = 2048  # queries of a step from which its prefill runs on that wrapper

_logged: set[str] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.log(level, message)


def backend_name(backend: Any) -> str:
    """"flashinfer" or "reference" (for logs and benchmark records)."""
    return "flashinfer" if isinstance(backend, FlashInferBackend) else "reference"


def select_backend(device: torch.device | str) -> Callable[..., torch.Tensor]:
    """The attention backend for a worker on `device` (see the module docstring)."""
    dev = torch.device(device)
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if dev.type == "cuda" and choice != "reference":
        try:
            backend = FlashInferBackend(dev)
        except ImportError as e:
            if choice == "flashinfer":
                raise
            _log_once(logging.WARNING, f"attention backend: reference paged attention on {dev} "
                      f"(flashinfer does not import: {e})")
            return paged_attention
        _log_once(logging.INFO, f"attention backend: flashinfer {backend.version} on {dev}")
        return backend
    why = f"{ENV_VAR}=reference" if choice == "reference" else f"device {dev.type}"
    _log_once(logging.INFO, f"attention backend: reference paged attention ({why})")
    return paged_attention


def unsupported(pool: KVPool) -> str | None:
    """Why FlashInfer cannot serve this pool, or None when it can."""
    if pool.device.type != "cuda":
        return f"the pool is on {pool.device.type}"
    if pool.dtype not in SUPPORTED_DTYPES:
        return f"KV dtype {pool.dtype} (FlashInfer runs fp16/bf16)"
    if pool.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {pool.head_dim} (compiled for {SUPPORTED_HEAD_DIMS})"
    return None


@dataclass
class _Step:
    """What `prepare` decided for the current step."""

    pool: KVPool
    meta: AttentionMetadata
    mode: str  # "decode" | "prefill" | "reference" | "empty"
    causal: bool = True
    custom: bool = False
    long: bool = False  # a long prefill: the second wrapper (module docstring)
    host: torch.Tensor | None = None  # int32: [qo_indptr |] kv_indptr | indices | last_page_len
    n_indices: int = 0
    planned_for: tuple[int, float] | None = None  # (q heads, scale) the wrapper was planned with


class FlashInferBackend:
    """FlashInfer batch decode/prefill over a KVPool (see the module docstring)."""

    def __init__(
        self,
        device: torch.device | str,
        *,
        workspace_bytes: int = WORKSPACE_BYTES,
        prefill_backend: str = "fa2",
        long_prefill_backend: str | None = None,
        graph_tensor_cores: bool | None = None,
    ):
        import flashinfer  # lazy: the CPU runtime never needs it

        self.fi = flashinfer
        self.version = str(getattr(flashinfer, "__version__", "?"))
        self.device = torch.device(device)
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        # Tensor-core decode under CUDA graphs was not measured on the device (device.md 5):
        # MSTAR_GRAPH_TENSOR_CORES=0 switches the graphs to the CUDA-core decode kernel.
        if graph_tensor_cores is None:
            graph_tensor_cores = os.environ.get("MSTAR_GRAPH_TENSOR_CORES", "1").strip() != "0"
        self.graph_tensor_cores = graph_tensor_cores
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=prefill_backend)
        if long_prefill_backend is None:
            long_prefill_backend = os.environ.get(LONG_PREFILL_ENV, "auto").strip() or "auto"
        self._prefill_long = (self._prefill if long_prefill_backend == prefill_backend else
                              flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                             backend=long_prefill_backend))
        self._step: _Step | None = None
        # per wrapper: its last plan's upload (module docstring), which a re-plan waits for: prefix
        # caching's chunks plan the prefill wrapper once per chunk within one step
        self._fences = {id(w): _PlanFence(self.device) for w in (self._decode, self._prefill, self._prefill_long)}
        # per pool: (q heads, scale) seen at its last call, so the next steps plan in prepare()
        self._learnt: dict[int, tuple[int, float]] = {}
        self._failed: set[tuple[str, bool, bool]] = set()  # (mode, custom mask, long) whose plan failed once
        self.plans = 0  # wrapper plans made (for tests and stats)

    # ------------------------------------------------------------------ protocol
    def prepare(self, pool: KVPool, meta: AttentionMetadata) -> None:
        self._step = step = self._decide(pool, meta)
        learnt = self._learnt.get(id(pool))
        if learnt is not None and step.mode in ("decode", "prefill"):
            self._plan(step, *learnt)

    def __call__(
        self, q: torch.Tensor, pool: KVPool, layer: int, meta: AttentionMetadata, scale: float | None
    ) -> torch.Tensor:
        step = self._step
        if step is None or step.pool is not pool or step.meta is not meta:
            self.prepare(pool, meta)  # a caller that skipped prepare(): plan now, once
            step = self._step
            assert step is not None
        if step.mode not in ("decode", "prefill"):
            return paged_attention(q, pool, layer, meta, scale)
        want = (q.shape[1], scale if scale is not None else 1.0 / math.sqrt(q.shape[2]))
        if step.planned_for != want:  # the pool's first step, or a node with another scale
            self._learnt[id(pool)] = want
            self._plan(step, *want)
            if step.mode == "reference":
                return paged_attention(q, pool, layer, meta, scale)
        wrapper = self._decode if step.mode == "decode" else self._prefill_long if step.long else self._prefill
        out = wrapper.run(q if q.dtype == pool.dtype else q.to(pool.dtype), pool.data[layer])
        return out if out.dtype == q.dtype else out.to(q.dtype)

    # ------------------------------------------------------------------ planning
    def _decide(self, pool: KVPool, meta: AttentionMetadata) -> _Step:
        reason = unsupported(pool)
        if reason is not None:
            _log_once(logging.INFO, f"flashinfer: reference attention for a pool with {reason}")
            return _Step(pool, meta, "reference")
        if not meta.seqs:
            return _Step(pool, meta, "empty")
        indptr, indices, last = meta.paged_kv_arrays(pool.page_size)
        pin = pool.device.type == "cuda"
        if all(s.q_len == 1 for s in meta.seqs):
            host = torch.tensor(indptr + indices + last, dtype=torch.int32, pin_memory=pin)
            return self._unless_failed(_Step(pool, meta, "decode", host=host, n_indices=len(indices)))
        kinds = {_effective_mask(s) for s in meta.seqs if s.q_len > 1}
        causal = kinds == {"causal"}
        custom = not (causal or kinds == {"full"})
        host = torch.tensor(meta.q_indptr() + indptr + indices + last, dtype=torch.int32, pin_memory=pin)
        long = not custom and sum(s.q_len for s in meta.seqs) >= LONG_PREFILL_TOKENS
        step = _Step(pool, meta, "prefill", causal=causal, custom=custom, long=long, host=host,
                     n_indices=len(indices))
        return self._unless_failed(step)

    def _unless_failed(self, step: _Step) -> _Step:
        """A step of a kind whose plan failed before goes straight to the reference."""
        if (step.mode, step.custom, step.long) in self._failed:
            step.mode = "reference"
        return step

    def _plan(self, step: _Step, q_heads: int, scale: float) -> None:
        pool, n, m = step.pool, len(step.meta.seqs), step.n_indices
        host = step.host
        assert host is not None
        common = dict(q_data_type=pool.dtype, kv_data_type=pool.dtype, sm_scale=scale, non_blocking=True)
        try:
            if step.mode == "decode":
                indptr, indices, last = host[: n + 1], host[n + 1 : n + 1 + m], host[n + 1 + m :]
                fence = self._fences[id(self._decode)]
                fence.wait()
                self._decode.plan(indptr, indices, last, q_heads, pool.kv_heads, pool.head_dim,
                                  pool.page_size, **common)
                fence.record()
            else:
                qo, kv = host[: n + 1], host[n + 1 : 2 * n + 2]
                indices, last = host[2 * n + 2 : 2 * n + 2 + m], host[2 * n + 2 + m :]
                mask = None
                if step.custom:
                    # FlashInfer packs the mask on the device and needs the indptrs there too.
                    dev = pool.device
                    qo, kv, indices, last = (t.to(dev) for t in (qo, kv, indices, last))
                    mask = _custom_mask(step.meta, dev)
                wrapper = self._prefill_long if step.long else self._prefill
                fence = self._fences[id(wrapper)]
                fence.wait()
                wrapper.plan(qo, kv, indices, last, q_heads, pool.kv_heads, pool.head_dim,
                             pool.page_size, causal=step.causal, custom_mask=mask, **common)
                fence.record()
        except Exception as e:  # noqa: BLE001 - any planning failure: the reference computes the same
            _log_once(logging.WARNING, f"flashinfer: {step.mode} plan failed ({type(e).__name__}: {e}); "
                      "this step kind uses the reference attention")
            self._failed.add((step.mode, step.custom, step.long))
            step.mode = "reference"
            return
        step.planned_for = (q_heads, scale)
        self.plans += 1

    # ------------------------------------------------------------------ graphs
    def graph_decoder(self, pool: KVPool, scale: float | None, tensor_cores: bool | None = None
                      ) -> Callable[[int, int], Any] | None:
        """A factory of per-bucket graph attention for the GraphRunner, or None when FlashInfer
        cannot serve this pool (the runner then stays eager). `tensor_cores`: the decode
        kernel (None: the backend's `graph_tensor_cores`)."""
        reason = unsupported(pool)
        if reason is not None:
            _log_once(logging.INFO, f"flashinfer: no CUDA-graph attention for a pool with {reason}")
            return None
        sm_scale = scale if scale is not None else 1.0 / math.sqrt(pool.head_dim)
        cores = self.graph_tensor_cores if tensor_cores is None else tensor_cores
        return lambda bucket, max_indices: FlashInferGraphDecode(self, pool, bucket, max_indices, sm_scale, cores)


def _effective_mask(s: SequenceAttention) -> str:
    """The mask kind an entry needs: a block-causal entry whose queries all sit in its last
    block sees every key, i.e. it is "full" (a V-JEPA rollout step adds exactly one frame
    block), and then needs no custom mask."""
    if s.mask == "block_causal" and s.block_size and (s.kv_len - s.q_len) // s.block_size == (s.kv_len - 1) // s.block_size:
        return "full"
    return s.mask


def _custom_mask(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """Every entry's boolean [q_len, kv_len] mask (True = attend), flattened and concatenated."""
    parts = []
    for s in meta.seqs:
        m = attention_mask(s.q_len, s.kv_len, s.mask, s.block_size, device=device)
        parts.append(torch.ones(s.q_len * s.kv_len, dtype=torch.bool, device=device) if m is None else m.reshape(-1))
    return torch.cat(parts)


class FlashInferGraphDecode:
    """One bucket's decode attention for CUDA graphs: a `use_cuda_graph=True` wrapper with fixed
    indptr / indices / last_page_len buffers (device.md 2d), planned outside the graph before
    every replay; the captured `run` reads those buffers."""

    def __init__(self, backend: FlashInferBackend, pool: KVPool, bucket: int, max_indices: int, scale: float,
                 tensor_cores: bool | None = None):
        dev = pool.device
        self.pool, self.scale = pool, scale
        self.wrapper = backend.fi.BatchDecodeWithPagedKVCacheWrapper(
            backend.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=backend.graph_tensor_cores if tensor_cores is None else tensor_cores,
            paged_kv_indptr_buffer=torch.empty(bucket + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.empty(max_indices, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.empty(bucket, dtype=torch.int32, device=dev),
        )
        self.fence = _PlanFence(dev)

    def plan(self, step: Any, q_heads: int) -> None:
        p = self.pool
        self.fence.wait()  # the wrapper's pinned plan buffer: its previous upload must have run
        # indptr and last_page_len stay on the host (plan reads the lengths there); the indices
        # go up first, non-blocking from pinned memory: a graph wrapper copies host indices into
        # its fixed buffer with a blocking copy (FlashInfer only trusts device sources there)
        indices = step.indices.to(p.device, non_blocking=True)
        self.wrapper.plan(step.indptr, indices, step.last_page_len, q_heads, p.kv_heads, p.head_dim,
                          p.page_size, q_data_type=p.dtype, kv_data_type=p.dtype, sm_scale=self.scale,
                          non_blocking=True)
        self.fence.record()

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        out = self.wrapper.run(q if q.dtype == self.pool.dtype else q.to(self.pool.dtype), self.pool.data[layer])
        return out if out.dtype == q.dtype else out.to(q.dtype)


class FlashInferCohortDecode:
    """Decode attention of a cohort's rows (engine/cohort_engine.py): its own paged-decode
    wrapper on the backend's workspace, planned every step from the block table's host
    arrays (no per-entry metadata), then run per layer. Rows that add a block of `tokens`
    (> 1) get a paged prefill wrapper instead (FA2, as the backend's eager prefill), planned
    non-causal: a block sees its whole context and itself."""

    def __init__(self, backend: FlashInferBackend, pool: KVPool, scale: float | None, q_heads: int, tokens: int = 1,
                 tensor_cores: bool = True):
        self.pool, self.q_heads, self.tokens = pool, q_heads, tokens
        self.scale = scale if scale is not None else 1.0 / math.sqrt(pool.head_dim)
        if tokens > 1:
            self.wrapper = backend.fi.BatchPrefillWithPagedKVCacheWrapper(backend.workspace, "NHD", backend="fa2")
        else:
            self.wrapper = backend.fi.BatchDecodeWithPagedKVCacheWrapper(backend.workspace, "NHD",
                                                                          use_tensor_cores=tensor_cores)
        self.fence = _PlanFence(pool.device)

    def plan(self, indptr: Any, indices: Any, last: Any) -> None:
        p, q = self.pool, self.tokens
        self.fence.wait()  # the wrapper's pinned plan buffer: its previous upload must have run
        n, m = indptr.shape[0] - 1, indices.shape[0]
        qo = np.arange(0, (n + 1) * q, q, dtype=np.int32) if q > 1 else np.zeros(0, dtype=np.int32)
        host = pinned(np.concatenate([qo, indptr, indices, last]).astype(np.int32))
        a = qo.shape[0]
        kv = (host[a : a + n + 1], host[a + n + 1 : a + n + 1 + m], host[a + n + 1 + m :])
        common = {"q_data_type": p.dtype, "kv_data_type": p.dtype, "sm_scale": self.scale, "non_blocking": True}
        if q > 1:
            self.wrapper.plan(host[:a], *kv, self.q_heads, p.kv_heads, p.head_dim, p.page_size, causal=False, **common)
        else:
            self.wrapper.plan(*kv, self.q_heads, p.kv_heads, p.head_dim, p.page_size, **common)
        self.fence.record()

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        out = self.wrapper.run(q if q.dtype == self.pool.dtype else q.to(self.pool.dtype), self.pool.data[layer])
        return out if out.dtype == q.dtype else out.to(q.dtype)


# ---------------------------------------------------------------------------- fixed-block graphs and rows
class _PlanFence:
    """Orders a wrapper's re-plan after its previous plan's pinned-buffer upload (module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.event: Any = None

    def wait(self) -> None:
        if self.event is not None and not self.event.query():
            self.event.synchronize()  # only when the host is a whole step ahead of the GPU

    def record(self) -> None:
        if self.device.type != "cuda":
            return
        if self.event is None:
            self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(self.device))


def _accepts(fn: Any, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def graph_prefill(backend: Any, pool: KVPool, scale: float | None, tokens: int
                  ) -> Callable[[int, int], Any] | None:
    """A factory of per-bucket graph attention for a GraphRunner whose entries each add `tokens`
    tokens over their whole context, or None when the backend is not FlashInfer or cannot
    serve this pool (the runner then stays eager)."""
    if not isinstance(backend, FlashInferBackend):
        return None
    reason = unsupported(pool)
    if reason is not None:
        _log_once(logging.INFO, f"flashinfer: no CUDA-graph prefill for a pool with {reason}")
        return None
    sm_scale = scale if scale is not None else 1.0 / math.sqrt(pool.head_dim)
    return lambda bucket, max_indices: FlashInferGraphPrefill(backend, pool, bucket, max_indices, sm_scale, tokens)


class FlashInferGraphPrefill:
    """One bucket's attention of a fixed-block step for CUDA graphs: a `use_cuda_graph=True`
    prefill wrapper (FA2, as the backend's eager prefill) with fixed qo_indptr / kv indptr /
    indices / last_page_len buffers, planned non-causal outside the graph before every replay
    (`GraphRunner` only hands it steps whose entries see their whole context); the captured
    `run` reads those buffers."""

    def __init__(self, backend: FlashInferBackend, pool: KVPool, bucket: int, max_indices: int, scale: float,
                 tokens: int):
        dev = pool.device
        self.pool, self.scale, self.tokens = pool, scale, tokens
        self.wrapper = backend.fi.BatchPrefillWithPagedKVCacheWrapper(
            backend.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.empty(bucket + 1, dtype=torch.int32, device=dev),
            paged_kv_indptr_buf=torch.empty(bucket + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buf=torch.empty(max_indices, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buf=torch.empty(bucket, dtype=torch.int32, device=dev),
            backend="fa2",
        )
        # FlashInfer 0.7.4's graph planner sizes its query tiles for Q rows per entry when told
        # (else for the ragged worst case); older wrappers lack the argument
        self._hint = {"uniform_q_len": tokens} if _accepts(self.wrapper.plan, "uniform_q_len") else {}
        self._fence = _PlanFence(dev)

    def plan(self, step: Any, q_heads: int) -> None:
        p = self.pool
        # the lengths stay on the host (plan reads them there); the indices go up first,
        # non-blocking from pinned memory (a graph wrapper copies host indices blocking)
        indices = step.indices.to(p.device, non_blocking=True)
        self._fence.wait()
        self.wrapper.plan(step.qo_indptr, step.indptr, indices, step.last_page_len, q_heads, p.kv_heads,
                          p.head_dim, p.page_size, causal=False, q_data_type=p.dtype, kv_data_type=p.dtype,
                          sm_scale=self.scale, non_blocking=True, **self._hint)
        self._fence.record()

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        out = self.wrapper.run(q if q.dtype == self.pool.dtype else q.to(self.pool.dtype), self.pool.data[layer])
        return out if out.dtype == q.dtype else out.to(q.dtype)


def token_views(pool: KVPool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as pages of one token: two `[N, 1, kv_heads, head_dim]` views with
    equal strides over `pool.data[layer]`, N = (2 * num_pages - 1) * page_size. Row
    `token_view_index(slot)` of the first is the K of that slot, of the second its V."""
    data = pool.data
    if not data.is_contiguous():
        raise ValueError("token views need a contiguous KV pool")
    ps, h, d = pool.page_size, pool.kv_heads, pool.head_dim
    rows = (2 * pool.num_pages - 1) * ps
    base = data.storage_offset() + layer * data.stride(0)
    size, stride = (rows, 1, h, d), (h * d, h * d, d, 1)
    k = data.as_strided(size, stride, base)
    v = data.as_strided(size, stride, base + ps * h * d)
    return k, v


def token_view_index(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pool slots (page * page_size + offset) -> rows of `token_views` (int32, on the slots' device)."""
    return (slots // page_size * (2 * page_size) + slots % page_size).to(torch.int32)


def row_prefill(pool: KVPool) -> FlashInferRowPrefill | None:
    """A `FlashInferRowPrefill` for this pool, or None where the reference must serve it: not a
    cuda pool FlashInfer supports, `MSTAR_ATTENTION=reference`, or flashinfer not importable
    (logged once)."""
    if os.environ.get(ENV_VAR, "").strip().lower() == "reference":
        return None
    reason = unsupported(pool)
    if reason is not None:
        _log_once(logging.INFO, f"flashinfer: per-row attention by the reference for a pool with {reason}")
        return None
    try:
        return FlashInferRowPrefill(pool)
    except ImportError as e:
        _log_once(logging.WARNING, f"flashinfer: per-row attention by the reference (flashinfer does not import: {e})")
        return None


_row_workspaces: dict[torch.device, torch.Tensor] = {}
ROW_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace; one per device for every row wrapper


class FlashInferRowPrefill:
    """Query blocks attending to arbitrary token lists of a pool (module docstring): entry r's
    queries are packed rows qo_indptr[r]..qo_indptr[r+1]-1 and it sees the pool slots
    slots[kv_indptr[r]:kv_indptr[r+1]], every query all of them (non-causal). Planned once per
    step (`plan`), run once per layer (`run`) after the layer's new K/V are in the pool."""

    def __init__(self, pool: KVPool, *, prefill_backend: str = "fa2"):
        import flashinfer  # lazy: the CPU runtime never needs it

        dev = pool.device
        ws = _row_workspaces.get(dev)
        if ws is None:
            ws = _row_workspaces[dev] = torch.empty(ROW_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.pool = pool
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=prefill_backend)
        self._fence = _PlanFence(dev)
        self.plans = 0

    def plan(self, qo_indptr: Sequence[int], kv_indptr: Sequence[int], slots: torch.Tensor, q_heads: int,
             scale: float | None) -> None:
        """Host indptrs (lengths are read on the host), device slots (no host round trip)."""
        p = self.pool
        n = len(qo_indptr) - 1
        pin = p.device.type == "cuda"
        host = torch.tensor(list(qo_indptr) + list(kv_indptr) + [1] * n, dtype=torch.int32, pin_memory=pin)
        qo, kv, last = host[: n + 1], host[n + 1 : 2 * n + 2], host[2 * n + 2 :]
        indices = token_view_index(slots.to(p.device), p.page_size)
        sm_scale = scale if scale is not None else 1.0 / math.sqrt(p.head_dim)
        self._fence.wait()
        self.wrapper.plan(qo, kv, indices, last, q_heads, p.kv_heads, p.head_dim, 1, causal=False,
                          q_data_type=p.dtype, kv_data_type=p.dtype,
                          sm_scale=sm_scale, non_blocking=True)
        self._fence.record()
        self.plans += 1

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        out = self.wrapper.run(q if q.dtype == self.pool.dtype else q.to(self.pool.dtype),
                               token_views(self.pool, layer))
        return out if out.dtype == q.dtype else out.to(q.dtype)
