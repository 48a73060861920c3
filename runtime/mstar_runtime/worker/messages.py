"""Typed control messages between the conductor and worker processes.

Each message is a frozen dataclass with a ``type`` tag; on the wire it is one msgpack map
``{"type": tag, <field>: <value>, ...}``. ``decode`` accepts only the tags in
``MESSAGE_TYPES`` and checks every field against the dataclass annotations (exact field
set, exact types, nested structs), so a peer can never make us build an arbitrary object:
no pickle anywhere. Any malformed input, truncated or bit-flipped, raises ``MessageError``.
The codec (``encode``, ``decode``, the limits and dtypes) is worker/codec.py; this module
declares the messages and registers its allowlist there.

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
readback), ``CohortLeave``, ``CohortMove``, ``CohortShrink``, ``CohortAddPages`` (no answer); a
chained cohort's ``ChainOpen`` (answered by ``CohortReply``), ``ChainStep`` (``CohortStepped``),
``ChainJoin``, ``ChainMove`` (no answer).

Between the API process and an engine process (``mstar_runtime.engine_process``): API ->
engine ``EngineSubmit``, ``EngineCancel``, ``EngineAck``, ``EngineStatsRequest``, ``Shutdown``;
engine -> API ``EngineReady`` (once), ``EngineOutput``, ``EngineFinish``, ``EngineStatsReply``;
walk values ride as ``Value`` (a scalar, a small tensor, or a ``ShmRef`` to shared memory).
"""

import typing
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from mstar_runtime.engine.cohort_engine import CohortRead
from mstar_runtime.engine.engines import KVSlots, ReadSlots
from mstar_runtime.worker.codec import (
    MAX_INLINE_TENSOR_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_TENSOR_DIMS,
    TENSOR_DTYPES,
    MessageError,
    Scalar,
    decode,
    dtype_name,
    encode,
    register,
)


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
    ``phase``, the loop's fed, invariant and index ports, the phase's outputs), answered by
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
    reads: list[CohortRead] = field(default_factory=list)  # the contexts the phase reads, in its order
    index: list[str] = field(default_factory=list)  # input ports bound to the loop's index


@dataclass(frozen=True, slots=True, eq=False)
class CohortJoinRow:
    """One row of a ``CohortJoin``: request ``request_id``'s context ``tag`` (its page table,
    its KV length, its fed ``fed:<port>`` and invariant ``inv:<port>`` inputs, split as a
    ``StepEntry``'s: ``values`` follow the frame over torch.distributed, in row order, in the
    join's one buffer; ``refs`` inputs this worker kept from the request's last replicated
    step, a TP member's own copy); ``steps`` the most steps the row may take (None: the
    cohort's bound), ``tokens`` the tokens each of its steps adds."""

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
    read_pages: list[list[int]] = field(default_factory=list)  # the page table of each context it reads
    read_lens: list[int] = field(default_factory=list)  # and its length


@dataclass(frozen=True, slots=True, eq=False)
class CohortJoin:
    """Conductor -> worker: ``rows`` become rows ``first``, ``first + 1``, ... of cohort
    ``cohort``, all of them or none; answered by ``CohortReply``, or ``StepRejected`` (naming
    the row's request) when the node refuses one of them."""

    type: ClassVar[str] = "cohort_join"
    step_id: int
    cohort: int
    first: int
    rows: list[CohortJoinRow]


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


# A chained cohort (engine/cohort_chain.py): one cohort id for the chain, one per link, each
# link's rows joined, left, moved, shrunk and paged by the single-call messages above.
@dataclass(frozen=True, slots=True)
class ChainImport:
    """Link ``link``'s input ``port`` is link ``source``'s output ``output`` of the same step."""

    link: int
    port: str
    source: int
    output: str


@dataclass(frozen=True, slots=True)
class ChainOpen:
    """Conductor -> worker: open each of ``links`` (as its ``CohortOpen`` would; ``step_id``
    unused there, the same ``rows`` in each) and chain them as cohort ``cohort``; ``flag_link``
    and ``flag_port`` the loop's ``until`` (None: a fixed loop). Answered by ``CohortReply``
    (``ok`` False: a link's node offers no column step, and no link stays opened)."""

    type: ClassVar[str] = "chain_open"
    step_id: int
    cohort: int
    links: list[CohortOpen]
    imports: list[ChainImport]
    flag_link: int | None = None
    flag_port: str = ""


@dataclass(frozen=True, slots=True)
class ChainJoin:
    """Conductor -> worker: rows ``first``, ... of chain ``cohort`` joined every link;
    ``stops``: whether each one's flag (its prefill's) already said stop. No answer."""

    type: ClassVar[str] = "chain_join"
    cohort: int
    first: int
    stops: list[bool]


@dataclass(frozen=True, slots=True)
class ChainMove:
    """Conductor -> worker: row ``src``'s chain state (its stop flag) moves to row ``dst``. No answer."""

    type: ClassVar[str] = "chain_move"
    cohort: int
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class ChainStep:
    """Conductor -> worker: one chained step of rows 0..n-1, answered by ``CohortStepped``
    (every link's packed readback in one, its ports named ``k.port``; ``send_outputs`` as
    ``CohortStep``'s)."""

    type: ClassVar[str] = "chain_step"
    step_id: int
    cohort: int
    n: int
    send_outputs: bool = True


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
    | ChainOpen
    | ChainJoin
    | ChainMove
    | ChainStep
    | EngineSubmit
    | EngineOutput
    | EngineFinish
    | EngineCancel
    | EngineAck
    | EngineStatsRequest
    | EngineStatsReply
    | EngineReady
)

# The allowlists: the only classes decode will ever instantiate (the union's members).
MESSAGE_TYPES: dict[str, type] = {cls.type: cls for cls in typing.get_args(Message)}
# KVSlots and ReadSlots are the engine's records (engine/engines.py), CohortRead the cohort's
# (engine/cohort_engine.py), declared once there; a CohortOpen rides in a ChainOpen too
STRUCT_TYPES: frozenset[type] = frozenset({StepEntry, ResultEntry, TensorMeta, KVSlots, ReadSlots, SlotCopy, ShmRef,
                                           Value, PackedPort, CohortJoinRow, CohortRead, CohortOpen,
                                           ChainImport})


register(MESSAGE_TYPES.values(), STRUCT_TYPES)

__all__ = ["MAX_INLINE_TENSOR_BYTES", "MAX_MESSAGE_BYTES", "MAX_TENSOR_DIMS", "MESSAGE_TYPES", "STRUCT_TYPES",
           "TENSOR_DTYPES", "Message", "MessageError", "Scalar", "decode", "dtype_name", "encode"]
