"""The contract between the runtime and a model's node implementations (`mstar_models.*`).

A plan names each node's implementation class (`impl`, e.g.
`mstar_models.orpheus.LlamaBackbone`). The worker builds it with a `NodeSpec` and calls it
with a *batch* of entries, one per request (or per KV tag of a request), for one phase:

- `StatelessNode.run(phase, batch) -> outputs`: `batch[i]` maps the phase's input ports to
  values (tensors on the node's device, or Python scalars for `str`/`int`/`float`/`bool`
  ports); `outputs[i]` maps its output ports to values. Implementations should batch the
  work themselves (stack equal shapes, one forward): the engine never loops per request.
- `KVNode.kv_plan(phase, shapes) -> SeqPlan` (a classmethod: the conductor calls it before
  the step, without the weights, to reserve KV pages) says how many KV tokens the step adds
  for one entry and which mask its queries use; then `KVNode.run(phase, batch, attn)` runs
  the step, calling `attn.attend(layer, q, k, v)` in every attention layer. The context
  writes the new K/V into the paged pool (unless the plan says `keep=False`) and attends
  over the entry's whole KV context, for the whole mixed batch (prefill chunks and
  single-token decodes together) in one call. A loop phase offered as a column step
  (`KVNode.cohort_phase`, ops/cohort.py) need not be written again as `phase_<name>`: `run`
  then runs the column step over the batch (ops/column_call.py).

A phase that reads other KV contexts (`reads` in the plan: pi0's action expert over the
VLM's prefix, a decoder's cross-attention over its `cross` tag) also attends to those
contexts of the same request, read-only, layer by layer: `attn.reads` names them in the
phase's order (`"vlm@main"`), `attn.seqs[i].read_lens` gives their lengths per entry, and

- `attn.attend(layer, q, k, v, over=(0,))` writes the new K/V and attends, in ONE softmax,
  to the read contexts named in `over` (every query sees all of them) and then to the
  entry's own context with its mask (pi0: the action tokens attend to prefix + themselves);
- `attn.attend_to(layer, q, context)` attends to one read context only, writing nothing
  (Whisper's cross-attention, with its own projections and softmax);
- `attn.write(layer, k, v)` stores the new tokens' K/V without attending (a phase that only
  fills a context, e.g. the cross-attention K/V of the encoder's frames).

Prefix caching (docs/runtime.md, "Prefix caching"): a node whose phase's KV depends only on
what its inputs hold says so with `prefix_content(phase, inputs, spec)`, a content key per
new token (its id; `prefix_cache.media_key` for a position that holds an embedding). The
conductor then shares cached pages for the leading full blocks it finds (up to a multiple of
the prefix chunk), and the step gets `seq.cached` > 0: the first `cached` tokens of the
entry's inputs are in the KV already (`seq.start` counts them), and the node computes the
other `seq.q_len` only, at positions `start ..`. A node without `prefix_content` never sees
`cached` > 0. With the cache on, the rows such a causal step computes inside `run_graphed`
run in chunks at absolute multiples of the prefix chunk (engine/chunked.py), so that a hit
computes them in the same pieces as its miss: a node's prefill should run its layers there.

Per-(request, tag) state that is not KV (a RoPE offset, sampling history, an RNG) lives in
`attn.states[i]`: a dict the engine keeps with the KV context, copies on `fork` and drops
when the request ends or is preempted (so a recomputed request starts from the same state).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from mstar_runtime.ops.column_call import run_columns
from mstar_runtime.ops.errors import NodeError, RequestError  # noqa: F401  (re-exported: nodes import both from here)
from mstar_runtime.ops.readback import upload

Batch = list[dict[str, Any]]


@dataclass(frozen=True)
class NodeSpec:
    """Everything a node implementation is built from (all of it comes from the plan)."""

    name: str
    engine: str  # "kv" | "stateless"
    config: Mapping[str, Any]  # the model's config (the compiled variant's values)
    arch_args: Mapping[str, Any]  # the node's `arch` line arguments
    settings: Mapping[str, Any]  # the node's own settings
    dtype: torch.dtype
    device: torch.device
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # a torch.distributed process group when tp_size > 1


@dataclass(frozen=True)
class SeqPlan:
    """How one entry of a KV step uses its context."""

    q_len: int  # new tokens (queries) of this step
    mask: str = "causal"  # "causal" | "full" | "block_causal"
    block_size: int | None = None  # for block_causal
    keep: bool = True  # False: the queries attend to the cache and to each other, but are not kept


@dataclass
class SeqState:
    """One entry of a KV step as its node sees it."""

    start: int  # KV tokens of this context before the step (absolute position of the first query)
    q_len: int
    state: dict[str, Any]  # persistent per-(request, tag) state, owned by the engine
    read_lens: tuple[int, ...] = ()  # tokens of each context the phase reads (`AttentionContext.reads` order)
    cached: int = 0  # leading tokens of the entry's inputs already in the KV (prefix caching): not computed


ReadFn = Callable[[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None, tuple[int, ...]], torch.Tensor]
"""`(layer, q, k, v, over) -> out`: attention over the read contexts `over` (indices into
`AttentionContext.reads`) and, when k/v are given, the entry's own context after writing them."""


@dataclass
class AttentionContext:
    """The attention of one KV step over a mixed batch; built by the KVCacheEngine."""

    seqs: list[SeqState]
    attend_fn: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    device: torch.device
    extra: dict[str, Any] = field(default_factory=dict)
    # Set by an engine that replays CUDA graphs or runs prefix caching's chunks (`run_graphed`);
    # None runs `fn` eagerly, whole (CPU, prefill, big batches).
    graph_runner: Callable[..., Any] | None = None
    # The contexts this step reads besides its own ("node@tag", the phase's `reads` order),
    # the engine's attention over them, and its store-only write (see the module docstring).
    reads: tuple[str, ...] = ()
    read_fn: ReadFn | None = None
    write_fn: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    @property
    def states(self) -> list[dict[str, Any]]:
        return [s.state for s in self.seqs]

    @property
    def num_tokens(self) -> int:
        return sum(s.q_len for s in self.seqs)

    def positions(self) -> torch.Tensor:
        """Default absolute positions of the packed queries: start .. start + q_len - 1 per entry."""
        # built on the host and uploaded once: per-entry aranges would be a kernel per entry
        return upload([p for s in self.seqs for p in range(s.start, s.start + s.q_len)], torch.long, self.device)

    def split(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Packed per-token rows -> one tensor per entry."""
        return list(torch.split(packed, [s.q_len for s in self.seqs]))

    def last_rows(self, packed: torch.Tensor) -> torch.Tensor:
        """The last row of each entry (e.g. the hidden state that predicts the next token)."""
        ends, at = [], -1
        for s in self.seqs:
            at += s.q_len
            ends.append(at)
        return packed.index_select(0, upload(ends, torch.long, packed.device))

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, over: Sequence[int | str] = ()
    ) -> torch.Tensor:
        """Store k/v of the new tokens and attend. q: [N, H, D], k/v: [N, Hkv, D].

        With `over` (read contexts, by index into `reads` or by name: `"vlm"`, `"vlm@main"`),
        the softmax runs over those contexts' tokens (all visible to every query) followed by
        the entry's own context under its mask."""
        if not over:
            return self.attend_fn(layer, q, k, v)
        return self._read(layer, q, k, v, tuple(self.read_index(c) for c in over))

    def attend_to(self, layer: int, q: torch.Tensor, context: int | str = 0) -> torch.Tensor:
        """Attention of the queries [N, H, D] over one read context only (every query sees all
        of it); writes nothing. An entry whose read context is empty gets zeros."""
        return self._read(layer, q, None, None, (self.read_index(context),))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K/V [N, Hkv, D] without attending (not inside `run_graphed`)."""
        if self.write_fn is None:
            raise NodeError("this step's engine cannot write K/V without attending")
        self.write_fn(layer, k, v)

    def read_index(self, context: int | str) -> int:
        """The index in `reads` of a read context given by index, "node@tag" or "node" (its first read)."""
        if isinstance(context, int) and not isinstance(context, bool):
            if 0 <= context < len(self.reads):
                return context
        elif isinstance(context, str):
            for i, name in enumerate(self.reads):
                if name == context or name.partition("@")[0] == context:
                    return i
        raise NodeError(
            f"this step reads no context {context!r}; it reads: {', '.join(self.reads) or 'none'} "
            "(a phase reads what its `reads` clause names)"
        )

    def _read(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
              over: tuple[int, ...]) -> torch.Tensor:
        if self.read_fn is None:
            raise NodeError("this step reads no other KV context (its phase has no `reads`)")
        return self.read_fn(layer, q, k, v, over)

    def run_graphed(self, fn: Callable[..., Any], *tensors: torch.Tensor, names: tuple[str, ...] | None = None
                    ) -> Any:
        """Run the tensor function `fn(*tensors)` -- a node's forward without its host logic.

        `fn` must be pure tensor code whose only attention is `self.attend`, whose inputs
        are the packed per-token tensors given here (first dim = tokens of the batch) and
        whose outputs are tensors (or a tuple or a dict of them) with the same first dim. An engine
        that captures CUDA graphs (the plan's `cuda-graphs` pass says which steps) pads the
        inputs into static buffers of the batch bucket, captures `fn` once per bucket and
        replays it; a step with prefix caching's chunks runs `fn` once per chunk over its rows
        and joins the outputs (engine/chunked.py); everywhere else `fn` simply runs. So `fn`
        must treat its rows independently but for `attend`. Sampling and other host logic stay
        outside `fn`, in `run`.

        `names`: where what `fn` computes depends on more than its code (a column step reads
        its tensors by the ports the step's entries carry), the tensors' names; a replay runs
        the captured `fn`, so a step whose names differ from the captured step's runs eagerly.
        """
        if self.graph_runner is None:
            return fn(*tensors)
        if names is None:
            return self.graph_runner(fn, *tensors)
        return self.graph_runner(fn, *tensors, names=names)


@dataclass(frozen=True)
class KVGeometry:
    layers: int
    kv_heads: int  # per rank
    head_dim: int


class StatelessNode(nn.Module):
    """Base of stateless nodes (encoders, codecs, VAEs, samplers): batched forward per phase."""

    engine: ClassVar[str] = "stateless"

    def __init__(self, spec: NodeSpec):
        super().__init__()
        self.spec = spec

    def run(self, phase: str, batch: Batch) -> Batch:
        method = getattr(self, f"phase_{phase}", None)
        if method is None:
            raise NodeError(f"node '{self.spec.name}' ({type(self).__name__}) has no phase '{phase}'")
        return method(batch)

    def graph_phase(self, phase: str) -> Any:
        """The phase split for CUDA-graph capture (a `stateless_graphs.GraphPhase`: host-side
        prepare, pure tensor fn, finish), or None: the phase runs eagerly. Override to offer a
        fixed-shape phase (Orpheus' SNAC window decode does); runtime/mstar_runtime/engine/stateless_graphs.py."""
        return None


class KVNode(nn.Module):
    """Base of stateful nodes that own paged KV contexts (LLM backbones, AC predictors)."""

    engine: ClassVar[str] = "kv"

    def __init__(self, spec: NodeSpec):
        super().__init__()
        self.spec = spec

    @property
    def kv_geometry(self) -> KVGeometry:
        raise NotImplementedError

    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: NodeSpec) -> SeqPlan:
        """KV tokens one entry adds in `phase`, from its inputs' shapes (no weights needed)."""
        raise NotImplementedError

    @classmethod
    def prefix_content(cls, phase: str, inputs: Mapping[str, Any], spec: NodeSpec) -> list[int] | None:
        """Prefix caching: one content key (int >= 0) per KV token the phase adds for an entry
        with these inputs, when that KV depends on nothing else (the tokens before them count:
        the cache chains over them), else None (the default: never cached). Keys for the
        leading tokens only (a shorter list) let those be found cached and no others: the
        phase needs something of the rest that a cached block does not keep. Called by the
        conductor before the step (after `kv_plan`); a RequestError fails the request."""
        return None

    def run(self, phase: str, batch: Batch, attn: AttentionContext) -> Batch:
        """One batched call of `phase`: the node's `phase_<name>` method, else its column step
        (`cohort_phase`) run over the batch as a one-step cohort (ops/column_call.py), so that a
        loop phase is written once."""
        method = getattr(self, f"phase_{phase}", None)
        if method is not None:
            return method(batch, attn)
        cphase = self.cohort_phase(phase)
        if cphase is None:
            raise NodeError(f"node '{self.spec.name}' ({type(self).__name__}) has no phase '{phase}'")
        return run_columns(self.spec.name, cphase, batch, attn)

    def cohort_phase(self, phase: str) -> Any:
        """The phase as a column step for decode cohorts (an `ops.cohort.CohortPhase`), or None:
        the phase runs through `run` only. Override to offer a single-token phase (a decode)
        whose step is pure tensor code over all rows (runtime/mstar_runtime/ops/cohort.py)."""
        return None

    def export_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """One KV context's state as flat values that can cross ranks (a context the plan moves
        to another rank, docs/runtime.md "Multi-rank plans"): `name -> tensor | bool | int |
        float | str | None`. The default takes such values as they are and nested dicts of them
        as `outer/inner` names; anything else is a NodeError naming the node and the value:
        a node that keeps other values overrides this and `import_state`."""
        out: dict[str, Any] = {}

        def walk(prefix: str, d: Mapping[str, Any]) -> None:
            for k, v in d.items():
                name = f"{prefix}{k}"
                if not isinstance(k, str) or "/" in k or not k:
                    raise NodeError(f"node '{self.spec.name}': state key {name!r} cannot move to another rank "
                                    "(keys must be non-empty str without '/')")
                if isinstance(v, Mapping):
                    if not v:
                        raise NodeError(f"node '{self.spec.name}': state value '{name}' is an empty dict, which "
                                        "cannot move to another rank; override export_state/import_state")
                    walk(f"{name}/", v)
                elif v is None or isinstance(v, bool | int | float | str | torch.Tensor):
                    out[name] = v
                else:
                    raise NodeError(f"node '{self.spec.name}' ({type(self).__name__}): state value '{name}' is a "
                                    f"{type(v).__name__}, which cannot move to another rank; override "
                                    "export_state/import_state")

        walk("", state)
        return out

    def import_state(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The state `export_state` flattened, rebuilt on the receiving rank (`outer/inner`
        names back into nested dicts)."""
        out: dict[str, Any] = {}
        for name, v in values.items():
            *outer, last = name.split("/")
            d = out
            for k in outer:
                d = d.setdefault(k, {})
            d[last] = v
        return out


def stack_inputs(batch: Batch, port: str) -> torch.Tensor:
    """Stack one port of every entry along a new batch dim (entries must have equal shapes)."""
    return torch.stack([entry[port] for entry in batch])


def unstack(port: str, tensor: torch.Tensor) -> Batch:
    return [{port: t} for t in tensor.unbind(0)]
