"""The per-request interpreter of a walk's step program.

A `WalkTask` is a generator over the program tree (see docs/plan-format.md for the ops).
It runs until it needs something from the conductor and yields it:

- `StepCall`: one node phase for this request; resumed with the call's outputs.
- `WaitChunk`: the next chunk of a stream buffer (an `on stream` block); resumed with the
  `Chunk`, or `None` when the stream is done.
- `WaitSpace`: room in a bounded stream buffer before a producer step (backpressure).
- `Join`: child tasks (the branches of a `parallel`); resumed when all have finished.
- `Spawn`: a detached child task (an `on stream` block runs beside the main body).
  A stream whose producer is a walk input (`stream` on the input) is fed by the client
  through the conductor, which also closes it; the main body's end closes only the others.
- `ForkKV`: copy a KV context of this request to another tag (shared pages). In a
  speculative iteration a fork is preceded by one that keeps the destination under a backup
  tag, so that throwing the iteration away can undo it (`ForkUndo` in the KV log).
- `EnterCohort`: a loop the compiler marked as a cohort (`op["cohort"]`, fixed or dynamic; a
  chain of several calls too) asks to run
  as a row of the conductor's decode cohort (runtime/mstar_runtime/control/cohort.py);
  resumed with a `CohortExit` when the row leaves the loop, or with `None` when the
  conductor declines (the node offers no column step or refuses the row, the cohort is
  full, a context the call reads is moved): the interpreter then runs the loop itself, iteration by iteration.

Side effects on the request (emits, stream pushes, accumulations) go through a `Frame`,
so that a speculative `dynamic_loop` iteration can hold them back until the previous
iteration's stop flag has been read (see `_dynamic_loop`).

Lanes: a node may return `readback.Lazy` outputs, values that depend on device results
(Orpheus' 0-or-1-item `code`, its `done` flag). Resolving one waits for the step that made
it, so an effect that needs one (a push, an emit, an acc) is queued on the task's lane
and applied when the task's *next* step call comes back: by then that step has been
launched, and the wait for the previous one leaves the GPU busy. Once a lane holds an
effect, later effects of the task queue behind it, so their order never changes. A lane
is flushed as well before anything that could depend on its effects: a wait for stream
space, a fork, a join, the end of a loop, of a stream block and of the walk.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from mstar_runtime.control.streams import Chunk, StreamBuffer
from mstar_runtime.ops.node import RequestError
from mstar_runtime.ops.readback import is_lazy, resolve
from mstar_runtime.plan.planfile import cohort_call, iter_ops

Env = dict[str, Any]
Gen = Generator[Any, Any, None]


class ForkUndo(NamedTuple):
    """A fork made inside a speculative iteration, as its KV log records it: the destination
    context `key` of `node` was kept under the tag `backup` just before the fork."""

    node: str
    key: tuple[str, str]  # (request id, the fork's destination tag)
    backup: str


# a region's KV changes in order: (node, (request id, tag), start) per write, a ForkUndo per fork
KVLog = list[tuple[str, tuple[str, str], int] | ForkUndo]


class WalkOwner(Protocol):
    """The request a walk runs for, as its interpreter sees it (control/requests.py `Request`):
    where the walk's effects go."""

    id: str

    def emit(self, name: str, value: Any, mode: str) -> None: ...
    def push(self, stream_id: str, buffer: StreamBuffer, items: Any) -> None: ...
    def stream_closed(self, stream_id: str) -> None: ...
    def wasted_iteration(self, kv_log: KVLog) -> None: ...
    def release_context(self, node: str, tag: str) -> None: ...


class WalkError(Exception):
    """A request's walk cannot continue (a bad value at run time); fails that request only."""


@dataclass(eq=False)
class StepCall:
    """One node phase for one request: its request by id (the conductor holds the request), the
    KV context's tag, the resolved inputs, and where the step's effects go."""

    op: dict[str, Any]
    request_id: str
    tag: str | None
    inputs: dict[str, Any]
    frame: Frame
    seq: int = 0  # set by the conductor: global issue order, for fair scheduling


@dataclass(eq=False)
class WaitChunk:
    buffer: StreamBuffer


@dataclass(eq=False)
class WaitSpace:
    buffer: StreamBuffer
    items: int


@dataclass(eq=False)
class Join:
    tasks: list[WalkTask]


@dataclass(eq=False)
class Spawn:
    task: WalkTask


@dataclass(eq=False)
class ForkKV:
    node: str
    src: str
    dst: str


@dataclass(eq=False)
class EnterCohort:
    op: dict[str, Any]  # the marked loop
    env: Env  # the loop's environment (its `until` flag as bound before the loop, if any)
    frame: Frame  # where the loop's effects go
    inputs: dict[str, Any]  # the call's resolved inputs for the first iteration
    count: int | None = None  # a fixed loop's trip count (a dynamic loop's bound is its op's `max`)


@dataclass(eq=False)
class CohortExit:
    """A cohort row's loop is over: the carried values of its last valid iteration (none if it
    ran none), the stream items it produced that did not fit into their buffers yet, and the
    speculative steps that were thrown away."""

    carry: dict[str, Any]
    pushes: list[tuple[str, torch.Tensor]]
    wasted: int = 0


class _Wasted(Exception):
    """Raised inside a speculative iteration when the previous iteration's flag said stop."""

    def __init__(self, frame: Frame):
        super().__init__("wasted speculative iteration")
        self.frame = frame


@dataclass(eq=False)
class Frame:
    """Where a region's side effects go.

    In a speculative iteration (`pending_flag` set), effects are buffered until the first
    step call of the iteration has been issued; then the previous iteration's flag is read:
    if it says stop, the iteration is abandoned (`_Wasted`), else the buffered effects are
    applied and the iteration continues normally.
    """

    request: WalkOwner
    parent: Frame | None = None
    pending_flag: Any = None
    deferred: list[Callable[[], None]] = field(default_factory=list)
    kv_log: KVLog = field(default_factory=list)
    # backups of the forks made while this frame was the innermost speculative one: freed when
    # it stands (a discarded iteration's undo takes them back instead)
    backups: list[tuple[str, str]] = field(default_factory=list)  # (node, backup tag)
    accs: dict[str, list[Any]] | None = None
    # the task's lane (see the module docstring): shared with the parent unless given
    lane: list[tuple[Frame, Callable[[], None]]] | None = None

    def __post_init__(self) -> None:
        if self.lane is None:
            self.lane = self.parent.lane if self.parent is not None else []

    @property
    def speculative(self) -> bool:
        return self.pending_flag is not None

    def effect(self, fn: Callable[[], None]) -> None:
        if self.speculative:
            self.deferred.append(fn)
        elif self.parent is not None:
            self.parent.effect(fn)
        else:
            fn()

    def effect_on_lane(self, fn: Callable[[], None], lazy: bool) -> None:
        """`effect(fn)`, queued on the lane when `fn` resolves a lazy value or the lane is busy."""
        assert self.lane is not None
        if lazy or self.lane:
            self.lane.append((self, fn))
        else:
            self.effect(fn)

    def flush_lane(self) -> None:
        """Apply the lane's queued effects, in order (each through the frame that queued it)."""
        assert self.lane is not None
        if not self.lane:  # the common case: called at every step call's return
            return
        queued = list(self.lane)
        self.lane.clear()
        for frame, fn in queued:
            frame.effect(fn)

    def after_first_step(self) -> None:
        """Called after every step call: resolves the speculative iterations this call belongs to.

        Outer iterations first: if an outer loop's previous flag said stop, the inner ones
        do not matter.
        """
        chain: list[Frame] = []
        f: Frame | None = self
        while f is not None:
            if f.speculative:
                chain.append(f)
            f = f.parent
        for f in reversed(chain):
            f._resolve()

    def _resolve(self) -> None:
        flag, self.pending_flag = self.pending_flag, None
        if read_flag(flag):
            raise _Wasted(self)
        effects, self.deferred = self.deferred, []
        for fn in effects:
            self.effect(fn)
        backups, self.backups = self.backups, []
        for node, tag in backups:  # no discarded iteration can need them now
            self.request.release_context(node, tag)

    def innermost_speculative(self) -> Frame | None:
        f: Frame | None = self
        while f is not None and not f.speculative:
            f = f.parent
        return f

    def log_kv(self, node: str, key: tuple[str, str], start: int) -> None:
        self._log((node, key, start))

    def log_fork(self, undo: ForkUndo) -> None:
        self._log(undo)

    def _log(self, entry: tuple[str, tuple[str, str], int] | ForkUndo) -> None:
        f: Frame | None = self
        while f is not None:
            f.kv_log.append(entry)
            f = f.parent

    def acc_target(self, name: str) -> list[Any]:
        f: Frame | None = self
        while f is not None:
            if f.accs is not None and name in f.accs:
                return f.accs[name]
            f = f.parent
        raise WalkError(f"acc {name} outside of a loop")  # the compiler rejects this; defensive


def _cohort_inputs(op: dict[str, Any], value: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """A marked loop's inputs as its row joins: its call's arguments by port; a chain's, each
    link's by `k.port`, but for the `chained` ones (an earlier link's output, not bound yet)."""
    mark = op["cohort"]
    if "links" not in mark:
        return {port: value(arg) for port, arg in cohort_call(op)["args"].items()}
    calls = {c["id"]: c for c in op["body"]["body"] if c.get("op") == "call"}
    out = {}
    for k, link in enumerate(mark["links"]):
        chained = {port for port, _, _ in link.get("chained") or ()}
        out.update({f"{k}.{port}": value(arg) for port, arg in calls[link["call"]]["args"].items() if port not in chained})
    return out


def read_flag(value: Any) -> bool:
    """A stop flag's truth. A tensor read here is the one host sync of a speculative loop step."""
    value = resolve(value)
    if isinstance(value, torch.Tensor):
        return bool(value.reshape(-1)[0].item()) if value.numel() else False
    return bool(value)


def concat(values: list[Any]) -> Any:
    """Accumulated values: tensors concatenated along dim 0 (scalars stacked), strings joined."""
    if not values:
        return torch.zeros(0)
    values = [resolve(v) for v in values]
    if all(isinstance(v, str) for v in values):
        return "".join(values)
    tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in values]
    if any(t.dim() == 0 for t in tensors):
        return torch.stack([t.reshape(()) for t in tensors])
    return torch.cat(tensors, dim=0)


class WalkTask:
    """One concurrently running part of a request's walk: the main body, a branch, a stream block."""

    def __init__(self, request: WalkOwner, gen: Gen, name: str, parent: WalkTask | None = None):
        self.request, self.gen, self.name, self.parent = request, gen, name, parent
        self.done = False
        self.waiting_children = 0


class Interpreter:
    """Builds the generators of one request's walk. The conductor drives them."""

    def __init__(self, request: WalkOwner, program: dict[str, Any], buffers: dict[str, StreamBuffer]):
        self.request = request
        self.program = program
        self.buffers = buffers  # stream id -> this request's buffer
        self._backups = 0  # forks kept for an undo so far (their backup tags' numbers)

    def main_task(self, env: Env) -> WalkTask:
        frame = Frame(self.request)
        fed = {p["stream"] for p in self.program["inputs"] if p.get("stream")}

        def body() -> Gen:
            # `on stream` blocks start with their walk and run beside it, wherever they are
            # written: a consumer that started only when reached would let its producer fill
            # the buffer and stall (or, after a loop, turn streaming into batch).
            for op in (o for o in iter_ops(self.program["program"]) if o["op"] == "on_stream" and "carry" not in o):
                buffer = self.buffers[op["stream"]]
                yield Spawn(WalkTask(self.request, self._stream_block(op, dict(env), buffer), op["id"]))
            yield from self._region(self.program["program"], env, frame)
            frame.flush_lane()
            for sid in self.program.get("streams", []):  # every producer is done: flush the streams
                if sid in fed:
                    continue  # a stream the client feeds closes when the client closes its input
                self.buffers[sid].close()
                self.request.stream_closed(sid)

        return WalkTask(self.request, body(), "main")

    # ---- operands
    def _value(self, operand: dict[str, Any], env: Env) -> Any:
        if "var" in operand:
            name = operand["var"]
            if name not in env:
                raise WalkError(f"value '{name}' is not bound")
            return env[name]
        value = operand["const"]
        return torch.tensor(value) if isinstance(value, list) else value

    # ---- regions
    def _region(self, op: dict[str, Any], env: Env, frame: Frame) -> Gen:
        kind = op["op"]
        if kind == "seq":
            for child in op["body"]:
                yield from self._region(child, env, frame)
        elif kind == "call":
            yield from self._call(op, env, frame)
        elif kind == "loop":
            if op["dynamic"]:
                yield from self._dynamic_loop(op, env, frame)
            else:
                yield from self._loop(op, env, frame)
        elif kind == "parallel":
            yield from self._parallel(op, env, frame)
        elif kind == "on_stream":
            if "carry" in op:  # a stream loop: in line, here
                yield from self._stream_loop(op, env, frame)
            # else started with the walk (main_task)
        elif kind == "emit":
            value = self._value(op["value"], env)
            name, mode = op["output"], op["mode"]
            frame.effect_on_lane(lambda: self.request.emit(name, resolve(value), mode), is_lazy(value))
        elif kind == "acc":
            value = self._value(op["value"], env)
            target = frame.acc_target(op["name"])
            frame.effect_on_lane(lambda: target.append(value), False)  # `concat` resolves
        elif kind == "fork":
            frame.flush_lane()
            spec = frame.innermost_speculative()
            if spec is not None:  # the iteration may be thrown away: keep what the fork replaces
                self._backups += 1
                backup = f"{op['dst']}~undo{self._backups}"
                yield ForkKV(op["node"], op["dst"], backup)
                frame.log_fork(ForkUndo(op["node"], (self.request.id, op["dst"]), backup))
                spec.backups.append((op["node"], backup))
            yield ForkKV(op["node"], op["src"], op["dst"])
        elif kind == "transfer":
            pass  # values live with the conductor between steps; the worker proxy moves them (docs/runtime.md)
        else:
            raise WalkError(f"unknown op '{kind}' in the step program")

    def _call(self, op: dict[str, Any], env: Env, frame: Frame) -> Gen:
        inputs = {port: resolve(self._value(arg, env)) for port, arg in op["args"].items()}
        for feed in op.get("feeds", ()):
            # backpressure: do not run a producer whose consumer lags by a full buffer, counting
            # the pushes still queued on the lane (lazy items, one each)
            buf = self.buffers[feed["stream"]]
            queued = sum(1 for _, fn in frame.lane if getattr(fn, "stream_buffer", None) is buf) if frame.lane else 0
            if not buf.can_push(1 + queued):
                frame.flush_lane()  # the queued pushes may be what the consumer waits for
            while not buf.can_push(1):
                yield WaitSpace(buf, 1)
        outputs = yield StepCall(op, self.request.id, op.get("tag"), inputs, frame)
        # this step has been launched: the previous one's lazy effects can resolve now
        frame.flush_lane()
        frame.after_first_step()
        for port, name in op["results"]:
            env[name] = outputs[port]
        for feed in op.get("feeds", ()):
            items = outputs[feed["port"]]
            buf = self.buffers[feed["stream"]]
            sid = feed["stream"]
            def push(buf: StreamBuffer = buf, items: Any = items, sid: str = sid) -> None:
                self.request.push(sid, buf, resolve(items))

            push.stream_buffer = buf  # type: ignore[attr-defined]  # counted by the backpressure check above
            frame.effect_on_lane(push, is_lazy(items))

    def _loop(self, op: dict[str, Any], env: Env, frame: Frame) -> Gen:
        count = resolve(self._value(op["count"], env))
        count = int(count.item()) if isinstance(count, torch.Tensor) else int(count)
        if count < 0 or (op.get("max") is not None and count > op["max"]):
            # a request input out of range is the request's fault: name the input it came from
            name = op["count"].get("var")
            limit = f"0..{op['max']}" if op.get("max") is not None else ">= 0"
            raise RequestError(f"'{name}' = {count} is outside {limit} (the bound of loop {op['id']})", name)
        if op.get("cohort") is not None and count > 0:
            done = yield from self._enter_cohort(op, env, frame, count)
            if done:
                return
        accs = {a["name"]: [] for a in op["acc"]}
        loop_frame = Frame(self.request, parent=frame, accs=accs)
        for i in range(count):
            inner = dict(env)
            if op.get("index"):
                inner[op["index"]] = i
            yield from self._region(op["body"], inner, loop_frame)
            for name in op["carry"]:
                env[name] = inner[name]
        loop_frame.flush_lane()
        loop_frame.effect(lambda: env.update({n: concat(v) for n, v in accs.items()}))

    def _dynamic_loop(self, op: dict[str, Any], env: Env, frame: Frame) -> Gen:
        """DynamicLoop, speculatively: iteration i+1 is issued before iteration i's flag is read.

        The flag of iteration i is read right after iteration i+1's first step call comes back
        (on the GPU: after it was launched, so the read never stalls the device). If it says
        stop, iteration i+1 is thrown away: its KV appends are truncated, the forks it made
        undone (the destination's context was kept under a backup tag before each), its
        effects dropped, and one wasted step is counted.
        """
        if op.get("cohort") is not None:
            done = yield from self._enter_cohort(op, env, frame, None)
            if done:
                return
        accs = {a["name"]: [] for a in op["acc"]}
        # A flag already bound before the loop (e.g. by a prefill) is checked before the first
        # iteration -- speculatively too: iteration 0 is issued before that flag is read.
        pending = env.get(op["until"])
        for i in range(op["max"]):
            inner = dict(env)
            if op.get("index"):
                inner[op["index"]] = i
            it_frame = Frame(self.request, parent=frame, pending_flag=pending, accs=accs)
            try:
                yield from self._region(op["body"], inner, it_frame)
                if it_frame.speculative:  # a body without step calls: resolve the flag now
                    it_frame._resolve()
            except _Wasted as e:
                if e.frame is not it_frame:
                    raise  # an outer loop's iteration is being abandoned
                self.request.wasted_iteration(it_frame.kv_log)
                break
            for name in op["carry"]:
                env[name] = inner[name]
            pending = inner[op["until"]]
        frame.flush_lane()
        frame.effect(lambda: env.update({n: concat(v) for n, v in accs.items()}))

    def _enter_cohort(self, op: dict[str, Any], env: Env, frame: Frame,
                      count: int | None) -> Generator[Any, Any, bool]:
        """Ask to run a marked loop as a cohort row; True (the generator's value) when it did:
        its carried values are bound and what it could not push is pushed. False: the
        conductor declined, and the caller runs the loop itself."""
        # the index ports' first value (the cohort counts them up per row)
        at = {**env, op["index"]: 0} if op.get("index") else env
        inputs = _cohort_inputs(op, lambda arg: resolve(self._value(arg, at)))
        done: CohortExit | None = yield EnterCohort(op, env, frame, inputs, count)
        if done is None:
            return False
        env.update(done.carry)
        yield from self._push_held(done.pushes, frame)
        frame.flush_lane()
        return True

    def _push_held(self, pushes: list[tuple[str, torch.Tensor]], frame: Frame) -> Gen:
        """Push what a cohort row could not push while it ran, with backpressure."""
        if pushes:
            frame.flush_lane()  # the row's flushed effects first, in order
        for sid, items in pushes:
            buf = self.buffers[sid]
            while items.shape[0]:
                room = buf.capacity - buf.pending if not buf.closed else items.shape[0]
                if room <= 0:
                    frame.flush_lane()
                    yield WaitSpace(buf, 1)
                    continue
                part, items = items[:room], items[room:]
                frame.effect_on_lane(lambda buf=buf, part=part, sid=sid: self.request.push(sid, buf, part), False)

    def _parallel(self, op: dict[str, Any], env: Env, frame: Frame) -> Gen:
        envs = [dict(env) for _ in op["branches"]]
        # each branch is its own task, with its own lane
        tasks = [WalkTask(self.request, self._branch(b["body"], e, Frame(self.request, parent=frame, lane=[])),
                          b["name"]) for b, e in zip(op["branches"], envs)]
        frame.flush_lane()
        yield Join(tasks)
        for e in envs:  # fan-in: each branch binds distinct names (checked by the compiler)
            env.update({k: v for k, v in e.items() if k not in env or env[k] is not v})

    def _branch(self, body: dict[str, Any], env: Env, frame: Frame) -> Gen:
        yield from self._region(body, env, frame)
        frame.flush_lane()

    def _stream_block(self, op: dict[str, Any], env: Env, buffer: StreamBuffer,
                      parent: Frame | None = None) -> Gen:
        """Run `op`'s body once for each chunk of `buffer` until the stream ends: each run in a
        copy of `env` with the chunk bound to `op["as"]`, in its own frame (a child of `parent`,
        none for a block spawned with the walk), its lane flushed when it ends. The names in
        `op["carry"]` (a stream loop's; a block has none) are copied back into `env` after each
        run, so the next run and what follows the loop see them."""
        while True:
            chunk: Chunk | None = yield WaitChunk(buffer)
            if chunk is None:
                return
            inner = dict(env)
            inner[op["as"]] = ChunkValue(chunk)
            chunk_frame = Frame(self.request, parent=parent)
            yield from self._region(op["body"], inner, chunk_frame)
            chunk_frame.flush_lane()
            for name in op.get("carry", ()):
                env[name] = inner[name]

    def _stream_loop(self, op: dict[str, Any], env: Env, frame: Frame) -> Gen:
        """`on stream ... carry`: the chunks one after another in this task, each run seeing the
        walk's values and the carried ones the run before left; after the stream's end the
        carried values are bound as a loop leaves them."""
        buffer = self.buffers[op["stream"]]
        frame.flush_lane()  # what came before may be what the client waits for
        yield from self._stream_block(op, env, buffer, frame)


@dataclass(frozen=True)
class ChunkValue:
    """A stream chunk bound to a name: its items, and how many leading items are left context.

    Passed to a node input port as the items tensor, with the context count under the input
    key `"<port>:context"` (see `chunk_inputs`).
    """

    chunk: Chunk


def chunk_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """Unwrap chunk values for a node: `port` -> items tensor, `port:context` -> int, `port:final` -> bool."""
    out: dict[str, Any] = {}
    for port, value in inputs.items():
        if isinstance(value, ChunkValue):
            out[port] = value.chunk.items
            out[f"{port}:context"] = value.chunk.context
            out[f"{port}:final"] = value.chunk.final
        else:
            out[port] = value
    return out
