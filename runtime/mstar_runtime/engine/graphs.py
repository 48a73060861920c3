"""CUDA graphs for KV steps of a fixed size per entry: pad to a batch bucket, capture once per bucket, replay.

(Stateless steps, such as a codec's fixed-window decode, have their own runner:
runtime/mstar_runtime/engine/stateless_graphs.py.)

The `cuda-graphs` pass marks which (node, phase, rank) steps are captured and with which
batch buckets. For such a phase the `KVCacheEngine` owns one `GraphRunner` and installs it,
bound to the step, as `attn.graph_runner`; the node's `attn.run_graphed(fn, *tensors)` then
lands in `GraphRunner._run` instead of calling `fn` directly. A runner serves steps whose
entries all add the same number of tokens `Q` (the runner's `tokens`):
- decode batches (`Q == 1`, the default): every entry adds one token;
- fixed-block steps (`Q > 1`, a node declares it per phase with `graph_step_tokens`, e.g.
  the V-JEPA predictor's rollout `step`: one frame block of 2 + tokens_per_frame tokens per
  trajectory): every entry adds exactly Q tokens AND its queries see its whole context
  (`sees_whole_context`: a "full" entry, or a block-causal one whose queries all sit in
  its last block), so the attention is one non-causal prefill per entry with fixed query
  lengths. A causal or otherwise masked multi-token entry is never graphed.
There are at most as many entries as the largest bucket; for `Q > 1` buckets whose
`bucket * Q` exceeds the runner's token cap (`max_tokens`, default `DEFAULT_MAX_GRAPH_TOKENS`,
a node may set `graph_max_tokens`) are dropped: such steps are GPU-bound and run eagerly,
and each graph's static buffers and activations grow with `bucket * Q`. Anything else
(prefill, mixed batches, bigger batches) never gets a runner and runs eagerly.

What a step does:
1. `bind` (host, before the node runs): picks the smallest bucket B >= n entries and builds
   the padded host arrays once (`pad_step`): FlashInfer's qo_indptr (entry e's queries are
   rows e*Q .. e*Q+Q-1, fixed per bucket) / kv indptr / indices / last_page_len for B
   entries and the (page, offset) of every new token. Entries n..B-1 are pad entries: each
   has Q queries over a context of Q tokens made of the pool's scratch page (the page after
   the last usable one; the BlockManager never hands it out) repeated ceil(Q / page_size)
   times, and writes its Q new K/V there, so nothing real is read or overwritten and
   nothing ever reads the scratch page back.
2. `_run` (inside the node's `run_graphed`): on first use it captures `fn` for EVERY
   bucket, largest first, all in one memory pool (a smaller graph reuses the larger one's
   activations), each after two warm-up runs on a side stream, with all-pad metadata so the
   warm-ups write only the scratch page. Then, every step: copy the real rows into the
   bucket's static input buffers (non-blocking, from the host arrays), copy the new tokens'
   pages/offsets into its static index buffers, `plan()` the bucket's attention (always
   outside the graph), replay, and return the outputs' first n * Q rows (cloned: the static
   outputs are overwritten by the next replay). A caller that names its tensors
   (`run_graphed(..., names=)`: a column step, whose fn reads its ports by name) gets a step
   whose names differ from the captured ones run eagerly: the captured fn would read them in
   the captured step's places.

Inside the graph the node's `attn.attend(layer, q, k, v)` is routed to `_attend_static`: the
KV write is an index_put into `pool.data[layer]` at the static page/offset buffers, and the
attention is the bucket's own planned kernel: for decode a FlashInfer decode wrapper made
with `use_cuda_graph=True` and fixed indptr/indices/last_page_len buffers
(`flashinfer_backend.FlashInferGraphDecode`), for `Q > 1` a prefill wrapper made the same
way with a fixed qo_indptr too, planned non-causal (`flashinfer_backend.FlashInferGraphPrefill`).
Because replays do not run Python, `fn` must be the same tensor computation every step, its
only attention `attn.attend`, with no host reads, its inputs and outputs packed per token
(first dim = n * Q; see `AttentionContext.run_graphed`).

`capture=False` runs the same padding, bucketing, static buffers and slicing with `fn`
called eagerly on the padded buffers and the reference attention (`ReferenceBucketDecode`,
which serves any padded step): the CPU tests check the bookkeeping that way
(tests/test_graph_runner_cpu.py for decode, tests/test_vjepa2_graphs.py for Q > 1).
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mstar_runtime.kv.attention import AttentionMetadata, KVPool, SequenceAttention, paged_attention
from mstar_runtime.ops.node import AttentionContext, NodeError

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # before each capture: lazy inits (cuBLAS handles, FlashInfer JIT) must not happen in it


def first_rows(outputs: Any, bucket: int, n: int, node: str, what: str) -> Any:
    """The first `n` rows of a replay's static outputs (a tensor, a tuple or a dict of them), cloned:
    the next replay overwrites them. `node` and `what` name the output in the error for one
    that is not a tensor with a row per bucket entry (formatted only then: this runs every step)."""

    def cut(t: Any) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != bucket:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise NodeError(f"node '{node}': {what} must be a tensor with one row per entry, got {got} for a bucket of {bucket}")
        return t[:n].clone()

    if isinstance(outputs, Mapping):
        return {key: cut(t) for key, t in outputs.items()}
    return tuple(cut(t) for t in outputs) if isinstance(outputs, tuple) else cut(outputs)


def smallest_bucket(buckets: Sequence[int], n: int) -> int | None:
    """The smallest of the sorted `buckets` that holds n entries, or None when n is beyond the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if n >= 1 and i < len(buckets) else None


DEFAULT_MAX_GRAPH_TOKENS = 16384  # the cap on bucket * Q of a fixed-block (Q > 1) runner's graphs


def sees_whole_context(s: SequenceAttention) -> bool:
    """Whether every query of the entry attends to its whole context, so a non-causal prefill
    computes it: a "full" entry, a single query (any mask kind sees everything then), or a
    block-causal entry whose queries all sit in its last block (a V-JEPA rollout step adds
    exactly one frame block; flashinfer_backend._effective_mask says the same)."""
    if s.mask == "full" or s.q_len == 1:
        return True
    if s.mask == "block_causal" and s.block_size:
        return (s.kv_len - s.q_len) // s.block_size == (s.kv_len - 1) // s.block_size
    return False


@dataclass(frozen=True)
class PaddedStep:
    """One step padded to a bucket: host arrays (pinned on a GPU), built once per step."""

    bucket: int
    real: int  # entries of the step; entries real..bucket-1 are pad entries
    tokens: int  # Q: new tokens (queries) of every entry, pad entries included
    qo_indptr: torch.Tensor  # int32 [bucket + 1]: entry e's queries are rows e*Q .. e*Q + Q - 1
    indptr: torch.Tensor  # int32 [bucket + 1]
    indices: torch.Tensor  # int32 [indptr[-1]]
    last_page_len: torch.Tensor  # int32 [bucket]
    pages: torch.Tensor  # int64 [bucket * Q]: page of each new token
    offsets: torch.Tensor  # int64 [bucket * Q]: its offset in that page
    meta: AttentionMetadata  # the same batch for the reference attention (pad entries included)


PaddedDecode = PaddedStep  # the Q == 1 case (its earlier name)


class BucketAttention(Protocol):
    """The attention of one bucket: planned on the host once per step, run per layer (in a graph)."""

    def plan(self, step: PaddedStep, q_heads: int) -> None: ...

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor: ...


class ReferenceBucketDecode:
    """`paged_attention` over the padded batch (decode or fixed-block): what the CPU tests use
    (never captured: it reads page tables on the host)."""

    def __init__(self, pool: KVPool, scale: float | None):
        self.pool, self.scale = pool, scale
        self.meta: AttentionMetadata | None = None

    def plan(self, step: PaddedStep, q_heads: int) -> None:
        self.meta = step.meta

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        assert self.meta is not None, "plan() before run()"
        return paged_attention(q, self.pool, layer, self.meta, self.scale)


def _upload(values: list[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    # Pinned so that FlashInfer's plan and our static-buffer copies are true non-blocking H2D
    # copies; the caching host allocator keeps the block alive until they have run.
    return torch.tensor(values, dtype=dtype, pin_memory=pin)


def pad_step(
    meta: AttentionMetadata, slots: Sequence[int], bucket: int, page_size: int, scratch_page: int, pin: bool,
    tokens: int = 1, *, allow_empty: bool = False,
) -> PaddedStep:
    """The host arrays of a batch of entries that each add `tokens` tokens, padded with scratch
    entries to `bucket` entries (the module docstring). `allow_empty`: all pad entries (capture)."""
    n = len(meta.seqs)
    if not (0 if allow_empty else 1) <= n <= bucket or len(slots) != n * tokens or tokens < 1:
        raise ValueError(f"cannot pad {n} entries of {tokens} token(s) with {len(slots)} slots "
                         f"to a bucket of {bucket}")
    if any(s.q_len != tokens for s in meta.seqs):
        raise ValueError(f"every entry must add {tokens} token(s), got {[s.q_len for s in meta.seqs]}")
    indptr, indices, last = meta.paged_kv_arrays(page_size)
    pad = bucket - n
    pad_pages = -(-tokens // page_size)  # a pad entry's context: Q tokens of the scratch page, repeated
    indptr = indptr + [indptr[-1] + (i + 1) * pad_pages for i in range(pad)]
    indices = indices + [scratch_page] * (pad * pad_pages)
    last = last + [tokens - (pad_pages - 1) * page_size] * pad
    pad_offsets = [i % page_size for i in range(tokens)]
    pages = [s // page_size for s in slots] + [scratch_page] * (pad * tokens)
    offsets = [s % page_size for s in slots] + pad_offsets * pad
    qo = list(range(0, (bucket + 1) * tokens, tokens))
    ints32 = _upload(qo + indptr + indices + last, torch.int32, pin)
    ints64 = _upload(pages + offsets, torch.int64, pin)
    a = bucket + 1
    b, c = 2 * a, 2 * a + len(indices)
    scratch = SequenceAttention(tokens, tokens, (scratch_page,) * pad_pages, "full" if tokens > 1 else "causal")
    rows = bucket * tokens
    return PaddedStep(
        bucket=bucket, real=n, tokens=tokens, qo_indptr=ints32[:a], indptr=ints32[a:b], indices=ints32[b:c],
        last_page_len=ints32[c:], pages=ints64[:rows], offsets=ints64[rows:],
        meta=AttentionMetadata(meta.seqs + (scratch,) * pad),
    )


def pad_decode(
    meta: AttentionMetadata, slots: Sequence[int], bucket: int, page_size: int, scratch_page: int, pin: bool
) -> PaddedStep:
    """The host arrays of a decode batch padded with scratch rows to `bucket` rows."""
    return pad_step(meta, slots, bucket, page_size, scratch_page, pin, 1)


@dataclass
class _Bucket:
    """The static state of one bucket: input/index buffers, its attention, its graph and outputs."""

    size: int
    attention: BucketAttention
    pages: torch.Tensor
    offsets: torch.Tensor
    inputs: list[torch.Tensor] = field(default_factory=list)
    pending: PaddedStep | None = None  # what to plan at the first attend while the head count is unknown
    planned: bool = False
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    outputs: Any = None  # what fn returned during capture (static tensors)


class GraphRunner:
    """Pads, captures and replays one KV node's decode (Q == 1) or fixed-block (Q > 1) phase per
    batch bucket (module docstring)."""

    def __init__(
        self,
        pool: KVPool,
        buckets: Sequence[int],
        make_attention: Callable[[int, int], BucketAttention],
        *,
        scratch_page: int,
        capture: bool,
        name: str = "",
        tokens: int = 1,
        max_tokens: int | None = None,
    ):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {list(buckets)}")
        if tokens < 1:
            raise ValueError(f"tokens per entry must be >= 1, got {tokens}")
        if not 0 <= scratch_page < pool.num_pages:
            raise ValueError(f"scratch page {scratch_page} is not a page of the pool ({pool.num_pages} pages)")
        if capture and pool.device.type != "cuda":
            raise ValueError("CUDA graphs need a cuda pool; use capture=False elsewhere")
        self.pool = pool
        self.tokens = int(tokens)
        sizes = sorted(set(int(b) for b in buckets))
        if self.tokens > 1:  # bucket * Q rows per graph: keep those within the cap (at least the smallest)
            cap = DEFAULT_MAX_GRAPH_TOKENS if max_tokens is None else int(max_tokens)
            sizes = [b for b in sizes if b * self.tokens <= cap] or sizes[:1]
        self.buckets = sizes
        self.make_attention = make_attention
        self.scratch_page = scratch_page
        self.capture = capture
        self.name = name
        self.q_heads: int | None = None
        self.replays = 0  # steps served from this runner (for stats and tests)
        self.failed: str | None = None  # why capture failed; the runner then declines every step
        # the names of the captured step's tensors, where its caller gave them (a column step:
        # its fn follows its ports), and the steps run eagerly because theirs differed
        self.names: tuple[str, ...] | None = None
        self.renamed = 0
        self._state: dict[int, _Bucket] = {}
        self._mempool: Any = None

    @property
    def max_bucket(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def release(self) -> None:
        """Drop every captured graph and the graph pool; later steps run eagerly. Called
        before a process's torch.distributed groups end: a group's teardown can wait forever
        for NCCL work recorded in a graph that is still alive (runtime/mstar_runtime/worker/process.py end_group)."""
        self._state.clear()
        self._mempool = None
        self.failed = "released"

    def accepts(self, meta: AttentionMetadata, n_entries: int) -> bool:
        """A batch that fits a bucket and whose every entry attends with exactly Q new tokens
        (Q == 1: a decode batch; for one query at the end of its context the causal, full and
        block-causal masks all see the whole context, so the mask kind does not matter), for
        Q > 1 each over its whole context (`sees_whole_context`)."""
        n = len(meta.seqs)
        if self.failed is not None or n != n_entries or self.bucket_for(n) is None:
            return False
        q = self.tokens
        if q == 1:
            return all(s.q_len == 1 for s in meta.seqs)
        return all(s.q_len == q and sees_whole_context(s) for s in meta.seqs)

    def bind(self, attn: AttentionContext, meta: AttentionMetadata, slots: Sequence[int]
             ) -> Callable[..., Any]:
        """Build this step's padded host arrays and return the `attn.graph_runner` callable."""
        bucket = self.bucket_for(len(meta.seqs))
        if bucket is None:
            raise ValueError(f"{len(meta.seqs)} entries exceed the largest bucket {self.max_bucket}")
        step = pad_step(meta, slots, bucket, self.pool.page_size, self.scratch_page,
                        pin=self.pool.device.type == "cuda", tokens=self.tokens)
        return functools.partial(self._run, attn, step)

    # ------------------------------------------------------------------ the step
    def _run(self, attn: AttentionContext, step: PaddedStep, fn: Callable[..., Any],
             *tensors: torch.Tensor, names: tuple[str, ...] | None = None) -> Any:
        q = self.tokens
        n, rows = step.real, step.real * q
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != rows:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                want = f"{n}" if q == 1 else f"{n} entries x {q} tokens = {rows} rows"
                raise NodeError(f"node '{self.name}': run_graphed input {i} must be a tensor with one row per "
                                f"entry{'' if q == 1 else ' token'} ({want}), got {got}")
        if self.failed is not None:
            return fn(*tensors)
        if not self._state:
            self.names = names
            try:
                self._prepare_all(attn, fn, tensors)
            except Exception as e:  # noqa: BLE001 - a graph that cannot be captured must not fail serving
                self.failed = f"{type(e).__name__}: {e}"
                self._state.clear()
                log.warning("node '%s': CUDA-graph capture failed (%s); its %s steps run eagerly",
                            self.name, self.failed, "decode" if q == 1 else f"{q}-token")
                return fn(*tensors)  # this step, eagerly, through the engine's own attention
        elif names != self.names:
            # a replay runs the captured fn, which reads its tensors by the captured names'
            # places: this step's would land in other inputs' buffers
            if not self.renamed:
                log.warning("node '%s': a step's tensors %s differ from the captured %s; such steps run eagerly",
                            self.name, list(names or ()), list(self.names or ()))
            self.renamed += 1
            return fn(*tensors)
        b = self._state[step.bucket]
        if len(tensors) != len(b.inputs):
            raise NodeError(f"node '{self.name}': run_graphed got {len(tensors)} inputs; its graphs were captured "
                            f"with {len(b.inputs)}")
        for buf, t in zip(b.inputs, tensors, strict=True):
            if buf.shape[1:] != t.shape[1:] or buf.dtype != t.dtype:
                raise NodeError(f"node '{self.name}': run_graphed inputs changed shape or dtype since capture "
                                f"({tuple(buf.shape[1:])} {buf.dtype} -> {tuple(t.shape[1:])} {t.dtype})")
            buf[:rows].copy_(t, non_blocking=True)
        b.pages.copy_(step.pages, non_blocking=True)
        b.offsets.copy_(step.offsets, non_blocking=True)
        # plan() always here, outside any graph; only before the very first attend of an eager
        # runner is the head count unknown, and then the first attend plans this same step
        b.pending, b.planned = step, False
        if self.q_heads is not None:
            b.attention.plan(step, self.q_heads)
            b.planned = True
        self.replays += 1
        if self.capture:
            b.graph.replay()
            outputs = b.outputs
        else:
            outputs = self._call(attn, b, fn)
        return first_rows(outputs, step.bucket * q, rows, self.name, "a run_graphed output")

    # ------------------------------------------------------------------ capture
    def _new_bucket(self, size: int, like: Sequence[torch.Tensor]) -> _Bucket:
        dev, q, ps = self.pool.device, self.tokens, self.pool.page_size
        rows = size * q
        pad_pages = -(-q // ps)
        b = _Bucket(
            size=size,
            attention=self.make_attention(size, size * max(self.pool.num_pages, pad_pages)),
            pages=torch.full((rows,), self.scratch_page, dtype=torch.int64, device=dev),
            offsets=(torch.arange(rows, device=dev) % q) % ps,
            inputs=[torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in like],
        )
        # All-pad metadata: warm-ups and capture write and read only the scratch page.
        b.pending = pad_step(AttentionMetadata(()), [], size, ps, self.scratch_page, pin=False, tokens=q,
                             allow_empty=True)
        return b

    def _prepare_all(self, attn: AttentionContext, fn: Callable[..., Any], like: Sequence[torch.Tensor]) -> None:
        """First use: static buffers for every bucket and, when capturing, every graph (largest first)."""
        for size in reversed(self.buckets):
            b = self._new_bucket(size, like)
            self._state[size] = b
            if not self.capture:
                continue
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(device=self.pool.device)
            side.wait_stream(torch.cuda.current_stream(self.pool.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._call(attn, b, fn)
            torch.cuda.current_stream(self.pool.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a server thread reading earlier outputs (.cpu()) meanwhile must not
            # fail this capture (the stateless runner captures the same way)
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                b.outputs = self._call(attn, b, fn)
            b.graph = graph

    def _call(self, attn: AttentionContext, b: _Bucket, fn: Callable[..., Any]) -> Any:
        """Run fn on the bucket's static inputs with attention routed to the static path."""
        saved = attn.attend_fn
        attn.attend_fn = functools.partial(self._attend_static, b)
        try:
            return fn(*b.inputs)
        finally:
            attn.attend_fn = saved

    def _attend_static(self, b: _Bucket, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                       ) -> torch.Tensor:
        if q.shape[0] != b.size * self.tokens:
            raise NodeError(f"node '{self.name}': attend got {q.shape[0]} rows in a bucket of {b.size} "
                            f"entries x {self.tokens} token(s)")
        if not b.planned:  # only ever during a warm-up or an eager (capture=False) first call
            self.q_heads = q.shape[1]
            assert b.pending is not None
            b.attention.plan(b.pending, self.q_heads)
            b.planned = True
        data = self.pool.data
        data[layer, b.pages, 0, b.offsets] = k.to(data.dtype)
        data[layer, b.pages, 1, b.offsets] = v.to(data.dtype)
        return b.attention.run(q, layer)


# ---------------------------------------------------------------------------- wiring
def graph_buckets(cuda_graphs: Sequence[Mapping[str, Any]], node: str, rank: int) -> dict[str, tuple[int, ...]]:
    """phase -> batch buckets of the plan's `cuda_graphs` step entries for this node on this rank."""
    out: dict[str, tuple[int, ...]] = {}
    for g in cuda_graphs:
        if g.get("kind") == "step" and g.get("node") == node and g.get("rank") == rank and g.get("phase"):
            out[str(g["phase"])] = tuple(int(b) for b in g.get("buckets", ()))
    return {phase: buckets for phase, buckets in out.items() if buckets}


def graph_step_tokens(node: Any, phases: Mapping[str, Any]) -> dict[str, int]:
    """phase -> tokens every entry adds in a graphed step of it: the node's `graph_step_tokens`
    mapping where it names the phase (a fixed-block step such as the V-JEPA rollout), else 1
    (a decode step)."""
    declared = getattr(node, "graph_step_tokens", None) or {}
    return {phase: int(declared.get(phase, 1)) for phase in phases}


def graph_runners(
    pool: KVPool,
    phases: Mapping[str, Sequence[int]],
    backend: Any,
    scale: float | None,
    *,
    scratch_page: int,
    capture: bool | None = None,
    name: str = "",
    tokens: Mapping[str, int] | None = None,
    max_tokens: int | None = None,
) -> dict[str, GraphRunner]:
    """One GraphRunner per captured phase, or none for a phase whose steps the backend cannot
    attend inside a graph. `tokens`: phase -> tokens per entry (default 1: decode); a phase
    with more is served by the backend's graph prefill (`flashinfer_backend.graph_prefill`),
    with at most `max_tokens` rows per graph.

    `capture=None` captures on a cuda pool; `capture=False` keeps the bookkeeping with eager
    calls and the reference attention (any device)."""
    if not phases:
        return {}
    capture = pool.device.type == "cuda" if capture is None else capture
    tokens = tokens or {}
    out: dict[str, GraphRunner] = {}
    for phase, buckets in phases.items():
        q = int(tokens.get(phase, 1))
        make: Callable[[int, int], BucketAttention] | None
        if not capture:
            def make(bucket: int, max_indices: int) -> BucketAttention:
                return ReferenceBucketDecode(pool, scale)
        elif q == 1:
            factory = getattr(backend, "graph_decoder", None)
            make = factory(pool, scale) if factory is not None else None
        else:
            from mstar_runtime.kv.flashinfer_backend import graph_prefill  # no flashinfer import here

            make = graph_prefill(backend, pool, scale, q)
        if make is None:
            log.info("node '%s': no CUDA graphs for phase '%s' (its attention backend cannot run inside one); "
                     "eager steps", name, phase)
            continue
        out[phase] = GraphRunner(pool, buckets, make, scratch_page=scratch_page, capture=capture, name=name,
                                 tokens=q, max_tokens=max_tokens)
    return out
