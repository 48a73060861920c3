"""Typed control messages between the conductor and worker processes.

Each message is a frozen dataclass with a ``type`` tag; on the wire it is one msgpack map
``{"type": tag, <field>: <value>, ...}``. ``decode`` accepts only the tags in
``MESSAGE_TYPES`` and checks every field against the dataclass annotations (exact field
set, exact types, nested structs), so a peer can never make us build an arbitrary object:
no pickle anywhere. Any malformed input, truncated or bit-flipped, raises ``MessageError``.

Small tensors (token ids, stop flags) may ride inside a message as ``{dtype, shape, data}``
with raw little-endian bytes, capped at ``MAX_INLINE_TENSOR_BYTES``; activations go through
torch.distributed and messages only name them (``TensorMeta``: name, dtype, shape, in the
order of the step's one flat byte buffer). Python scalars ride as ``Scalar`` values: msgpack
keeps bool, int, float, str and nil apart, so that union decodes without ambiguity.

The conversation between the conductor and a worker process (``remote.py``):
conductor -> worker: ``StepRequest``, ``ForkKV``, ``CopySlots``, ``DropTag``, ``ImportKV``,
``ExportKV``, ``FreeRequest``, ``Heartbeat``, ``Shutdown``; worker -> conductor: ``WorkerReady``
(once), ``StepResult``, ``StepRejected`` (a node's ``RequestError``), ``WorkerError``,
``KVExported`` (the answer to ``ExportKV``), ``Heartbeat`` (the echo); over
a torchrun launch's control connection the worker first sends ``Hello``. Decode cohorts
(a marked loop of a node on this worker): conductor -> worker ``CohortOpen`` and ``CohortJoin``
(answered by ``CohortReply``), ``CohortStep`` (answered by ``CohortStepped``, the step's packed
readback), ``CohortLeave``, ``CohortMove``, ``CohortShrink``, ``CohortAddPages`` (no answer).

Between the API process and an engine process (``mstar_runtime.engine_process``): API ->
engine ``EngineSubmit``, ``EngineCancel``, ``EngineAck``, ``EngineStatsRequest``, ``Shutdown``;
engine -> API ``EngineReady`` (once), ``EngineOutput``, ``EngineFinish``, ``EngineStatsReply``;
walk values ride as ``Value`` (a scalar, a small tensor, or a ``ShmRef`` to shared memory).
"""

import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, get_args, get_origin

import msgpack
import torch

from mstar_runtime.engine.engines import KVSlots, ReadSlots

MAX_MESSAGE_BYTES = 64 << 20
MAX_INLINE_TENSOR_BYTES = 4 << 20
MAX_TENSOR_DIMS = 8

# Explicit allowlist of dtypes a message may carry, by wire name.
TENSOR_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_DTYPE_NAMES = {dt: name for name, dt in TENSOR_DTYPES.items()}

# A Python value that rides inside a message as itself (a node's `int`, `float`, `bool`
# or `str` port, or an absent optional value).
Scalar = bool | int | float | str | None
_PRIMITIVES = (bool, int, float, str, bytes)


class MessageError(ValueError):
    """A message that cannot be encoded or decoded: unknown type, bad field, corrupt bytes."""


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of an allowlisted dtype; a MessageError for any other."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise MessageError(f"dtype {dtype} cannot travel between ranks")
    return name


# ------------------------------------------------------------------- structs inside messages
@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A tensor that travels over torch.distributed: what the receiver allocates and views.

    The tensors of one step (every entry, in entry then list order) travel as one flat byte
    buffer, so the receiver needs only these to cut it up again."""

    name: str
    dtype: str
    shape: list[int]


@dataclass(frozen=True, slots=True)
class SlotCopy:
    """A BlockManager copy-on-write: slots ``src_start + i -> dst_start + i`` for i < count."""

    src_start: int
    dst_start: int
    count: int


@dataclass(frozen=True, slots=True, eq=False)
class StepEntry:
    """``engines.StepEntry`` on the wire: the same request id, ``tag`` (the KV context; None
    for a stateless node) and ``kv`` (the engine's own ``KVSlots``, carried as they are), with
    its input values split: ``inputs`` arrive over torch.distributed, ``inline`` holds small
    tensors, ``scalars`` Python values."""

    request_id: str
    tag: str | None
    inputs: list[TensorMeta]
    inline: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Scalar] = field(default_factory=dict)
    kv: KVSlots | None = None
    # input name -> the name of an output this worker kept from the last replicated step of
    # the same (node, request_id, tag): the worker's own copy stands in for the value
    refs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, eq=False)
class ResultEntry:
    """One request's outcome of a step: values produced, split like ``StepEntry``'s inputs
    (e.g. the sampled token and the stop flag a ``DynamicLoop`` reads ride inline)."""

    request_id: str
    tag: str | None
    outputs: list[TensorMeta]
    inline: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Scalar] = field(default_factory=dict)


# ------------------------------------------------------------------------------- messages
@dataclass(frozen=True, slots=True, eq=False)
class StepRequest:
    """Conductor -> worker: run ``node.phase`` once over a batch of requests."""

    type: ClassVar[str] = "step_request"
    step_id: int
    node: str
    phase: str
    entries: list[StepEntry]
    # a step every rank of a tensor-parallel group runs, with the same outputs on each: the
    # worker keeps its tensor outputs per (node, request_id, tag) for later `refs`
    replicated: bool = False
    # False: answer with a `StepResult` without entries, as soon as the step is launched
    # (the conductor takes the group leader's outputs; nothing waits for this rank's device)
    send_outputs: bool = True


@dataclass(frozen=True, slots=True, eq=False)
class StepResult:
    """Worker -> conductor: step ``step_id`` finished on ``rank``."""

    type: ClassVar[str] = "step_result"
    step_id: int
    rank: int
    entries: list[ResultEntry]
    elapsed_s: float = 0.0  # the worker's time from the step's frame to this answer
    waited_s: float = 0.0  # its time reading messages since its previous answer (idle + decoding)


@dataclass(frozen=True, slots=True)
class FreeRequest:
    """Conductor -> worker: drop every KV context and stream of a finished or cancelled request."""

    type: ClassVar[str] = "free_request"
    request_id: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Conductor -> worker: finish the current step, release resources, exit."""

    type: ClassVar[str] = "shutdown"
    reason: str = ""


@dataclass(frozen=True, slots=True)
class StepRejected:
    """Worker -> conductor: a node rejected step ``step_id``'s input (its ``RequestError``):
    fails those requests only (the conductor reruns a batch one by one to find the culprit)."""

    type: ClassVar[str] = "step_rejected"
    step_id: int
    rank: int
    message: str
    field: str | None
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class ForkKV:
    """Conductor -> worker: KV context ``dst_tag`` starts as ``src_tag`` (the conductor's
    BlockManager already shares the pages; ``copy`` is its copy-on-write of a partial page)."""

    type: ClassVar[str] = "fork_kv"
    node: str
    request_id: str
    src_tag: str
    dst_tag: str
    copy: SlotCopy | None = None


@dataclass(frozen=True, slots=True)
class CopySlots:
    """Conductor -> worker: apply a BlockManager copy-on-write (from a truncate) in ``node``'s pool."""

    type: ClassVar[str] = "copy_slots"
    node: str
    copy: SlotCopy


@dataclass(frozen=True, slots=True)
class DropTag:
    """Conductor -> worker: forget one KV context's node state (a transition that does not
    keep the tag; its pages are the conductor's to free)."""

    type: ClassVar[str] = "drop_tag"
    node: str
    request_id: str
    tag: str


@dataclass(frozen=True, slots=True, eq=False)
class ImportKV:
    """Conductor -> worker: KV context ``tag`` of ``request_id`` becomes a copy of one held on
    another rank (a plan's transfer of kind "kv"): its pages' contents go into ``pages`` (this
    rank's, in token order; the conductor's BlockManager gave them) and its node state
    replaces this rank's. ``values``/``inline``/``scalars`` split the values as a step's
    inputs are: ``kv`` (the pages, ``[layers, len(pages), 2, page_size, kv_heads,
    head_dim]``), ``has_state``, and ``state:<name>`` per value of the node's
    ``export_state``. The ``values`` follow the frame over torch.distributed."""

    type: ClassVar[str] = "import_kv"
    node: str
    request_id: str
    tag: str
    pages: list[int]
    values: list[TensorMeta]
    inline: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Scalar] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ExportKV:
    """Conductor -> worker: send KV context ``tag`` of ``request_id`` (the contents of its
    ``pages``, in token order, and its node state) to rank 0, which hands it to the rank that
    needs it; answered by ``KVExported``."""

    type: ClassVar[str] = "export_kv"
    node: str
    request_id: str
    tag: str
    pages: list[int]


@dataclass(frozen=True, slots=True, eq=False)
class KVExported:
    """Worker -> conductor: the answer to ``ExportKV``, its values split as in ``ImportKV``;
    the ``values`` follow the frame over torch.distributed."""

    type: ClassVar[str] = "kv_exported"
    rank: int
    values: list[TensorMeta]
    inline: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Scalar] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """Worker -> conductor, once: rank ``rank`` (process ``pid``) joined the process group and
    built its nodes from the plan whose canonical body hashes to ``plan_digest``."""

    type: ClassVar[str] = "worker_ready"
    rank: int
    pid: int
    nodes: list[str]
    plan_digest: str


@dataclass(frozen=True, slots=True)
class WorkerError:
    """Worker -> conductor: a step (or the worker itself, when ``step_id`` is None) failed."""

    type: ClassVar[str] = "worker_error"
    rank: int
    message: str
    step_id: int | None = None


@dataclass(frozen=True, slots=True)
class Hello:
    """Worker -> conductor, first on a control connection of a torchrun launch
    (`mstar_runtime.worker.launch`): rank ``rank`` (process ``pid`` on host ``host``, its
    torchrun node ``node``) with the job's ``token`` (a secret the conductor put in torchrun's
    store), so a connection from anything else is refused before any other frame is read."""

    type: ClassVar[str] = "hello"
    rank: int
    pid: int
    host: str
    node: int
    token: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Liveness, so a watchdog can tell a hung worker from a slow step: the conductor sends
    one, the worker echoes ``seq`` with its own rank."""

    type: ClassVar[str] = "heartbeat"
    rank: int
    seq: int



# ------------------------------------------------------------------- decode cohorts
# A marked loop of a node in a worker process (or at tp > 1, on every rank of its group) runs
# as a decode cohort there: the conductor's `control/cohort.py` owns membership and events, the
# worker the device columns (`engine/cohort_engine.py`). `cohort` is the id the conductor gave
# the cohort on this worker in `CohortOpen`.
@dataclass(frozen=True, slots=True)
class PackedPort:
    """One output of a cohort step in its packed readback: ``width`` columns of the int64
    (``is_float`` False) or float32 block, in packing order."""

    key: str
    is_float: bool
    width: int


@dataclass(frozen=True, slots=True)
class CohortOpen:
    """Conductor -> worker: make the device columns of cohort ``cohort`` (``node``'s
    ``phase``, the loop's fed and invariant ports, the phase's outputs), answered by
    ``CohortReply`` (``ok`` False: the node offers no column step for the phase)."""

    type: ClassVar[str] = "cohort_open"
    step_id: int
    cohort: int
    node: str
    phase: str
    fed: list[list[str]]  # [input port, output port that feeds it]
    invariant: list[str]
    outputs: list[str]
    rows: int
    max_pages: int


@dataclass(frozen=True, slots=True, eq=False)
class CohortJoin:
    """Conductor -> worker: request ``request_id``'s context ``tag`` becomes row ``row``
    (its page table, its KV length, its fed ``fed:<port>`` and invariant ``inv:<port>``
    inputs, split as a step's inputs: ``values`` follow the frame over torch.distributed;
    ``refs`` as a ``StepEntry``'s: inputs this worker kept from the request's last replicated
    step, a TP member's own copy); ``steps`` the most steps the row may take (None: the
    cohort's bound), ``tokens`` the tokens each of its steps adds; answered by
    ``CohortReply``, or ``StepRejected`` when the node's join refuses the row."""

    type: ClassVar[str] = "cohort_join"
    step_id: int
    cohort: int
    row: int
    request_id: str
    tag: str
    pages: list[int]
    length: int
    values: list[TensorMeta]
    inline: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Scalar] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    steps: int | None = None
    tokens: int = 1


@dataclass(frozen=True, slots=True)
class CohortReply:
    """Worker -> conductor: ``CohortOpen`` or ``CohortJoin`` ``step_id`` done (``ok``: opened)."""

    type: ClassVar[str] = "cohort_reply"
    step_id: int
    rank: int
    ok: bool = True


@dataclass(frozen=True, slots=True)
class CohortLeave:
    """Conductor -> worker: row ``row`` left after ``steps`` steps: its columns go back into
    the node state of ``request_id``'s context ``tag``. No answer."""

    type: ClassVar[str] = "cohort_leave"
    cohort: int
    row: int
    request_id: str
    tag: str
    steps: int


@dataclass(frozen=True, slots=True)
class CohortMove:
    """Conductor -> worker: row ``src``'s whole state moves to row ``dst``. No answer."""

    type: ClassVar[str] = "cohort_move"
    cohort: int
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class CohortShrink:
    """Conductor -> worker: the cohort has ``n`` rows now. No answer."""

    type: ClassVar[str] = "cohort_shrink"
    cohort: int
    n: int


@dataclass(frozen=True, slots=True)
class CohortAddPages:
    """Conductor -> worker: row ``rows[i]`` gets page ``pages[i]`` at table column ``cols[i]``. No answer."""

    type: ClassVar[str] = "cohort_add_pages"
    cohort: int
    rows: list[int]
    cols: list[int]
    pages: list[int]


@dataclass(frozen=True, slots=True)
class CohortStep:
    """Conductor -> worker: one step of rows 0..n-1, answered by ``CohortStepped``;
    ``send_outputs`` False (a TP member): an acknowledgement as soon as it is launched."""

    type: ClassVar[str] = "cohort_step"
    step_id: int
    cohort: int
    n: int
    send_outputs: bool = True


@dataclass(frozen=True, slots=True, eq=False)
class CohortStepped:
    """Worker -> conductor: cohort step ``step_id`` ran on ``rank``: its packed readback
    (``ints`` and ``floats`` in ``values``/``inline``, ``layout`` their ports; all empty for
    an acknowledgement); the ``values`` follow the frame over torch.distributed."""

    type: ClassVar[str] = "cohort_stepped"
    step_id: int
    rank: int
    layout: list[PackedPort]
    values: list[TensorMeta]
    inline: dict[str, torch.Tensor] = field(default_factory=dict)
    elapsed_s: float = 0.0
    waited_s: float = 0.0


# ------------------------------------------------- the API process <-> the engine process
# (`mstar_runtime.engine_process`: `mstar-run PLAN --serve --engine-process`)
@dataclass(frozen=True, slots=True)
class ShmRef:
    """A tensor left in a POSIX shared-memory block ``name`` (the reader copies, then unlinks)."""

    name: str
    dtype: str
    shape: list[int]


@dataclass(frozen=True, slots=True, eq=False)
class Value:
    """One walk input or output: a Python scalar, a small tensor inline, or a large one in
    shared memory (exactly one of them set, or none for an absent value)."""

    scalar: Scalar = None
    tensor: torch.Tensor | None = None
    shm: ShmRef | None = None


@dataclass(frozen=True, slots=True, eq=False)
class EngineSubmit:
    """API -> engine: run a request (inputs already checked against the walk by the API side)."""

    type: ClassVar[str] = "engine_submit"
    request_id: str
    walk: str
    inputs: dict[str, Value]
    timeout: float | None = None


@dataclass(frozen=True, slots=True, eq=False)
class EngineOutput:
    """Engine -> API: the ``seq``-th appended output item of a request."""

    type: ClassVar[str] = "engine_output"
    request_id: str
    seq: int
    name: str
    value: Value


@dataclass(frozen=True, slots=True, eq=False)
class EngineFinish:
    """Engine -> API: a request ended (``RequestHandle``'s outcome and final stats). An output
    named in ``streamed`` equals the concatenation of its ``EngineOutput`` items, which the API
    side already has: ``outputs`` holds only a ``Value(scalar=None)`` in its place (keeping the
    outputs' order), so large outputs (audio) cross once."""

    type: ClassVar[str] = "engine_finish"
    request_id: str
    state: str
    outputs: dict[str, Value]
    error: str | None
    field: str | None
    reason: str | None
    stats: dict[str, Scalar]
    walks: list[str]
    streamed: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class EngineCancel:
    """API -> engine: cancel a request (its client went away)."""

    type: ClassVar[str] = "engine_cancel"
    request_id: str


@dataclass(frozen=True, slots=True)
class EngineAck:
    """API -> engine: the API side has read ``consumed`` output items of a request (backpressure)."""

    type: ClassVar[str] = "engine_ack"
    request_id: str
    consumed: int


@dataclass(frozen=True, slots=True)
class EngineStatsRequest:
    """API -> engine: ask for ``MStar.stats()`` and the engine's health."""

    type: ClassVar[str] = "engine_stats_request"
    seq: int


@dataclass(frozen=True, slots=True)
class EngineStatsReply:
    """Engine -> API: ``MStar.stats()`` (its ``requests`` counts apart) and, when the engine
    cannot serve, the stable message and the details (``fault``, ``fault_detail``)."""

    type: ClassVar[str] = "engine_stats_reply"
    seq: int
    stats: dict[str, Scalar]
    requests: dict[str, int]
    fault: str | None = None
    fault_detail: str | None = None


@dataclass(frozen=True, slots=True)
class EngineReady:
    """Engine -> API, once: the plan is loaded and the engine serves (``error``: it could not start)."""

    type: ClassVar[str] = "engine_ready"
    pid: int
    error: str | None = None


Message = (
    StepRequest
    | StepResult
    | StepRejected
    | ForkKV
    | CopySlots
    | DropTag
    | ImportKV
    | ExportKV
    | KVExported
    | FreeRequest
    | Shutdown
    | WorkerReady
    | WorkerError
    | Heartbeat
    | Hello
    | CohortOpen
    | CohortJoin
    | CohortReply
    | CohortLeave
    | CohortMove
    | CohortShrink
    | CohortAddPages
    | CohortStep
    | CohortStepped
    | EngineSubmit
    | EngineOutput
    | EngineFinish
    | EngineCancel
    | EngineAck
    | EngineStatsRequest
    | EngineStatsReply
    | EngineReady
)

# The allowlists: the only classes decode will ever instantiate.
MESSAGE_TYPES: dict[str, type] = {
    cls.type: cls
    for cls in (
        StepRequest,
        StepResult,
        StepRejected,
        ForkKV,
        CopySlots,
        DropTag,
        ImportKV,
        ExportKV,
        KVExported,
        FreeRequest,
        Shutdown,
        WorkerReady,
        WorkerError,
        Heartbeat,
        Hello,
        CohortOpen,
        CohortJoin,
        CohortReply,
        CohortLeave,
        CohortMove,
        CohortShrink,
        CohortAddPages,
        CohortStep,
        CohortStepped,
        EngineSubmit,
        EngineOutput,
        EngineFinish,
        EngineCancel,
        EngineAck,
        EngineStatsRequest,
        EngineStatsReply,
        EngineReady,
    )
}
# KVSlots and ReadSlots are the engine's records (engine/engines.py), declared once there
STRUCT_TYPES: frozenset[type] = frozenset({StepEntry, ResultEntry, TensorMeta, KVSlots, ReadSlots, SlotCopy, ShmRef,
                                           Value, PackedPort})


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_SCHEMAS: dict[type, dict[str, Any]] = {
    cls: _field_types(cls) for cls in (*MESSAGE_TYPES.values(), *STRUCT_TYPES)
}


# ------------------------------------------------------------------------------- tensors
def _tensor_to_wire(t: torch.Tensor, path: str) -> dict[str, Any]:
    if t.dtype not in _DTYPE_NAMES:
        raise MessageError(f"{path}: dtype {t.dtype} cannot travel in a message")
    if t.dim() > MAX_TENSOR_DIMS:
        raise MessageError(f"{path}: {t.dim()} dims is over the limit of {MAX_TENSOR_DIMS}")
    nbytes = t.numel() * t.element_size()
    if nbytes > MAX_INLINE_TENSOR_BYTES:
        raise MessageError(f"{path}: {nbytes} bytes is too big to inline; send it over torch.distributed")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return {
        "dtype": _DTYPE_NAMES[t.dtype],
        "shape": list(t.shape),
        "data": flat.view(torch.uint8).numpy().tobytes(),
    }


def _tensor_from_wire(value: Any, path: str) -> torch.Tensor:
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data"}:
        raise MessageError(f"{path}: a tensor must be a map with exactly dtype, shape, data")
    dtype = TENSOR_DTYPES.get(value["dtype"]) if isinstance(value["dtype"], str) else None
    shape, data = value["shape"], value["data"]
    if dtype is None:
        raise MessageError(f"{path}: unsupported tensor dtype {value['dtype']!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_TENSOR_DIMS
        or not all(_is_int(d) and d >= 0 for d in shape)
    ):
        raise MessageError(f"{path}: bad tensor shape {shape!r}")
    if not isinstance(data, bytes):
        raise MessageError(f"{path}: tensor data must be bytes")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(shape) * itemsize != len(data):
        raise MessageError(f"{path}: {len(data)} data bytes do not match shape {shape} of {value['dtype']}")
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


# ------------------------------------------------------------------ schema-directed walk
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    if isinstance(tp, types.UnionType) or get_origin(tp) is typing.Union:
        return get_args(tp)
    return None


# annotation -> (its union, if it is one: (options but None, None allowed, all primitives);
# generic origin; generic args), worked out once per annotation, not once per value (a
# step's message holds thousands of values)
_Union = tuple[tuple[Any, ...], bool, bool]
_ANNOTATIONS: dict[Any, tuple[_Union | None, Any, tuple[Any, ...]]] = {}
# list items whose values are checked by exact type in one pass (int excludes bool, as _is_int)
_EXACT_ITEMS = frozenset({int, float, str, bytes, bool})


def _annotation(tp: Any) -> tuple[_Union | None, Any, tuple[Any, ...]]:
    info = _ANNOTATIONS.get(tp)
    if info is None:
        union = None
        if (options := _union_args(tp)) is not None:
            inner = tuple(o for o in options if o is not type(None))
            union = (inner, type(None) in options, len(inner) > 1 and all(o in _PRIMITIVES for o in inner))
        info = _ANNOTATIONS[tp] = (union, get_origin(tp), get_args(tp))
    return info


def _convert(value: Any, tp: Any, path: str, to_wire: bool) -> Any:
    """Check ``value`` against annotation ``tp`` and convert it to (or from) its wire form."""
    union, origin, args = _annotation(tp)
    if union is not None:
        inner, nullable, primitives = union
        if value is None and nullable:
            return None
        if primitives:
            return _convert_primitive_union(value, inner, path)
        if len(inner) != 1:  # else only ``X | None``: keep decoding unambiguous
            raise MessageError(f"{path}: unsupported union annotation {tp}")
        return _convert(value, inner[0], path, to_wire)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if _is_int(value):
            return value
    elif tp is float:
        if isinstance(value, float) or _is_int(value):
            return float(value)
    elif tp is str or tp is bytes:
        if isinstance(value, tp):
            return value
    elif tp is torch.Tensor:
        if to_wire and isinstance(value, torch.Tensor):
            return _tensor_to_wire(value, path)
        if not to_wire:
            return _tensor_from_wire(value, path)
    elif origin is list or origin is tuple:
        # a tuple[X, ...] (an engine record's field) travels as a msgpack array, as a list does
        if isinstance(value, list) or (to_wire and origin is tuple and isinstance(value, tuple)):
            item = _item_type(tp, origin, args, path)
            if item in _EXACT_ITEMS and all(type(v) is item for v in value):
                items = list(value)  # page tables, slot lists: no per-item walk (or path string)
            else:
                items = [_convert(v, item, f"{path}[{i}]", to_wire) for i, v in enumerate(value)]
            return tuple(items) if origin is tuple and not to_wire else items
    elif origin is dict:
        if isinstance(value, dict):
            key_tp, val_tp = args
            if key_tp is not str:
                raise MessageError(f"{path}: only str-keyed maps are supported")
            if not all(isinstance(k, str) for k in value):
                raise MessageError(f"{path}: map keys must be strings")
            return {k: _convert(v, val_tp, f"{path}.{k}", to_wire) for k, v in value.items()}
    elif tp in STRUCT_TYPES:
        if to_wire and isinstance(value, tp):
            return _fields_to_wire(value, path)
        if not to_wire and isinstance(value, dict):
            return tp(**_fields_from_wire(tp, value, path))
    else:
        raise MessageError(f"{path}: unsupported annotation {tp}")
    raise MessageError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__}")


def _item_type(tp: Any, origin: Any, args: tuple[Any, ...], path: str) -> Any:
    """The item annotation of ``list[X]`` or ``tuple[X, ...]``; fixed-length tuples do not travel."""
    if origin is list:
        return args[0]
    if len(args) != 2 or args[1] is not Ellipsis:
        raise MessageError(f"{path}: unsupported annotation {tp} (only tuple[X, ...])")
    return args[0]


def _convert_primitive_union(value: Any, options: Sequence[Any], path: str) -> Any:
    """A value of a union of msgpack primitives (``Scalar``): its own type must be one of the
    options, exactly (no int -> float widening, no bool as int), so encode and decode agree."""
    for tp in options:
        if tp is bool and isinstance(value, bool):
            return value
        if tp is int and _is_int(value):
            return int(value)
        if tp is float and isinstance(value, float):
            return float(value)
        if tp in (str, bytes) and isinstance(value, tp):
            return value
    names = " | ".join(_type_name(o) for o in options)
    raise MessageError(f"{path}: expected {names}, got {type(value).__name__}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _fields_to_wire(obj: Any, path: str) -> dict[str, Any]:
    return {
        name: _convert(getattr(obj, name), tp, f"{path}.{name}", to_wire=True)
        for name, tp in _SCHEMAS[type(obj)].items()
    }


def _fields_from_wire(cls: type, wire: dict[str, Any], path: str) -> dict[str, Any]:
    schema = _SCHEMAS[cls]
    missing = [n for n in schema if n not in wire]
    extra = sorted(str(k) for k in wire if k not in schema)
    if missing or extra:
        raise MessageError(
            f"{path}: {cls.__name__}"
            + (f" is missing {', '.join(missing)}" if missing else "")
            + (f" has unexpected {', '.join(extra)}" if extra else "")
        )
    return {name: _convert(wire[name], tp, f"{path}.{name}", to_wire=False) for name, tp in schema.items()}


# ------------------------------------------------------------------ compiled fast path
# The walk above builds a path string for every value it visits, so that an error names the
# exact place; a 64-entry decode step holds ~1,200 values. Each annotation also gets a
# compiled converter (closures, no paths) that accepts exactly what the walk accepts or
# less, and raises on anything else; `encode` and `decode` try it first and, when it
# declines, run the walk, which then raises the precise error (or, for a value the fast
# path is stricter about, such as a str subclass, converts it).
class _Decline(Exception):
    """The fast path does not take this value; the walk decides."""


_FAST: dict[tuple[Any, bool], Any] = {}


def _fast(tp: Any, to_wire: bool) -> Any:
    key = (tp, to_wire)
    conv = _FAST.get(key)
    if conv is None:
        conv = _FAST[key] = _build_fast(tp, to_wire)
    return conv


def _decline(value: Any) -> Any:
    raise _Decline


def _exact(tp: type) -> Any:
    def conv(value: Any) -> Any:
        if type(value) is tp:
            return value
        raise _Decline

    return conv


def _to_float(value: Any) -> float:
    t = type(value)
    if t is float:
        return value
    if t is int:
        return float(value)
    raise _Decline


def _build_fast(tp: Any, to_wire: bool) -> Any:  # noqa: C901 - one branch per annotation kind
    union, origin, args = _annotation(tp)
    if union is not None:
        inner, nullable, primitives = union
        if primitives:
            return lambda v: None if v is None and nullable else _convert_primitive_union(v, inner, "")
        if len(inner) != 1:
            return _decline
        sub = _fast(inner[0], to_wire)
        return (lambda v: None if v is None else sub(v)) if nullable else sub
    if tp in (bool, int, str, bytes):
        return _exact(tp)
    if tp is float:
        return _to_float
    if tp is torch.Tensor:
        if to_wire:
            return lambda v: _tensor_to_wire(v, "") if isinstance(v, torch.Tensor) else _decline(v)
        return lambda v: _tensor_from_wire(v, "")
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        item = args[0]
        sub = _fast(item, to_wire)
        exact = item in _EXACT_ITEMS
        # on the wire an array; in Python a list, or a tuple for a tuple[X, ...] field
        accepted = (list, tuple) if to_wire and origin is tuple else (list,)
        made = tuple if origin is tuple and not to_wire else list

        def convert_list(value: Any) -> Any:
            if type(value) not in accepted:
                raise _Decline
            if exact and all(type(v) is item for v in value):
                return made(value)
            return made([sub(v) for v in value])

        return convert_list
    if origin is dict:
        key_tp, val_tp = args
        if key_tp is not str:
            return _decline
        sub = _fast(val_tp, to_wire)

        def convert_dict(value: Any) -> dict[str, Any]:
            if type(value) is not dict or not all(type(k) is str for k in value):
                raise _Decline
            return {k: sub(v) for k, v in value.items()}

        return convert_dict
    if tp in _SCHEMAS:
        return _build_struct(tp, to_wire)
    return _decline


def _build_struct(cls: type, to_wire: bool) -> Any:
    schema = _SCHEMAS[cls]  # in dataclass field order: the positional order of cls(...)
    pairs = tuple((name, _fast(tp, to_wire)) for name, tp in schema.items())
    names = frozenset(schema)
    if to_wire:
        return lambda v: {n: c(getattr(v, n)) for n, c in pairs} if type(v) is cls else _decline(v)

    def from_wire(value: Any) -> Any:
        if type(value) is not dict or value.keys() != names:
            raise _Decline
        return cls(*[c(value[n]) for n, c in pairs])

    return from_wire


# ------------------------------------------------------------------------------ public API
def encode(msg: Message) -> bytes:
    """msgpack bytes of an allowlisted message; fields are checked as strictly as on decode."""
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "type", None)) is not cls:
        raise MessageError(f"{cls.__name__} is not an allowlisted message type")
    try:
        fields = _fast(cls, True)(msg)
    except Exception:  # noqa: BLE001 - the walk below is the authority, and names the place
        fields = _fields_to_wire(msg, cls.type)
    wire = {"type": cls.type, **fields}
    try:
        data = msgpack.packb(wire, use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as exc:  # e.g. an int beyond 64 bits
        raise MessageError(f"{cls.type}: cannot encode: {exc}") from exc
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(
            f"{cls.type}: {len(data)} bytes is over the {MAX_MESSAGE_BYTES}-byte message limit"
        )
    return data


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message in ``data``; raises ``MessageError`` for anything but a well-formed,
    allowlisted message."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MessageError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"{len(data)} bytes is over the {MAX_MESSAGE_BYTES}-byte message limit")
    try:
        # strict_map_key: only str/bytes keys; ext types and timestamps are rejected by the schema.
        wire = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many unrelated types for corrupt input
        raise MessageError(f"corrupt message: {type(exc).__name__}: {exc}") from exc
    if not isinstance(wire, dict):
        raise MessageError(f"a message must be a map, got {type(wire).__name__}")
    tag = wire.pop("type", None)
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {tag!r}; allowed: {', '.join(MESSAGE_TYPES)}")
    try:
        return _fast(cls, False)(wire)  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - the walk below is the authority, and names the place
        return cls(**_fields_from_wire(cls, wire, tag))
