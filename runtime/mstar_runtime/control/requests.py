"""Requests: their records, their typed inputs, and what their walks' effects do.

A `Request` is one client request as the conductor keeps it: its walk and inputs, its state
(`WAITING` -> `RUNNING` -> `FINISHED` / `FAILED` / `CANCELLED`; back to `WAITING` when
preempted), its outputs and what of them the client already has, and, per attempt, its walk
tasks, stream buffers and where its KV contexts were last written. The interpreter applies a
walk's effects through it (`emit`, `push`, `stream_closed`, `wasted_iteration`); the two of
them that concern the engine loop reach the conductor through `RequestHost`, a narrow
interface, never the conductor's own methods.

`check_inputs` is the one check of a request's inputs against its walk (`Conductor.submit`,
the API and the engine process call it): types, defaults, the plan's bounds, and the walk's
client-streamed inputs (`InputFeed`: every part fed, kept for a replay after preemption).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mstar_runtime.control.bounds import check_bounds
from mstar_runtime.control.interpreter import KVLog, StepCall, WalkTask
from mstar_runtime.control.streams import StreamBuffer
from mstar_runtime.control.validate import TORCH_DTYPES, coerce, validate_inputs
from mstar_runtime.ops.node import RequestError

WAITING, RUNNING, FINISHED, FAILED, CANCELLED = "waiting", "running", "finished", "failed", "cancelled"


class RequestHost(Protocol):
    """What a request's effects need of the engine loop (the conductor implements it)."""

    def stream_changed(self, buffer: StreamBuffer) -> None:
        """Items were pushed into `buffer`, or it closed: a task waiting for a chunk may go on."""

    def iteration_wasted(self, request: Request, kv_log: KVLog) -> None:
        """A speculative loop iteration of `request` was thrown away: its KV writes and forks are undone."""

    def context_released(self, request: Request, node: str, tag: str) -> None:
        """A context of `request` nothing will read again (a fork's backup) is freed."""


def empty_value(t: Mapping[str, Any]) -> Any:
    if t["kind"] == "str":
        return ""
    dtype = TORCH_DTYPES.get(t.get("dtype") or "f32", torch.float32)
    dims = [0] + [d if isinstance(d, int) else 0 for d in t.get("dims", [])[1:]]
    return torch.zeros(dims, dtype=dtype)


def stream_inputs(program: Mapping[str, Any]) -> dict[str, str]:
    """The walk's inputs the client streams in: input name -> stream id."""
    return {p["name"]: p["stream"] for p in program["inputs"] if p.get("stream")}


def coerce_items(walk: str, name: str, t: Mapping[str, Any], value: Any) -> torch.Tensor:
    """A part of a streamed input, checked against the input's type: its first dimension
    counts items (any number, also 0), the others and the dtype family as declared."""
    dims = list(t.get("dims") or [])
    return coerce(walk, name, {**t, "dims": ["items", *dims[1:]]}, value)


def port_input(request: Request, call: StepCall, port: str | None) -> str | None:
    """The walk variable a node's refused port was given, so that the error names what the
    caller sent (`talker.prefill(max_frames = talker_max_frames)` refusing `max_frames` is a
    bad `talker_max_frames`); the port itself when its argument is no input of the walk (a
    value an earlier step made names no request field)."""
    arg = call.op.get("args", {}).get(port) if port is not None else None
    var = arg.get("var") if isinstance(arg, Mapping) else None
    return var if isinstance(var, str) and var in request.current_inputs else port


def check_inputs(walk: str, program: Mapping[str, Any], inputs: Mapping[str, Any], *,
                 streaming: bool = False, config: Mapping[str, Any] | None = None,
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor | None]]:
    """`validate_inputs` for a walk that may have streamed inputs: (the other inputs, typed and
    defaulted; streamed input -> its whole value, or None when the client feeds it). A
    streamed input may be left out only when `streaming`. With the plan's `config`, also
    the bounds of image-generation inputs (`bounds.check_bounds`: every one out of bounds,
    in one error)."""
    streamed = stream_inputs(program)
    if not streamed:
        values = validate_inputs(walk, program, inputs)
        if config is not None:
            check_bounds(walk, config, program, {k: values[k] for k in inputs if k in values})
        return values, {}
    declared = {p["name"]: p for p in program["inputs"]}
    plain = {**program, "inputs": [p for p in program["inputs"] if p["name"] not in streamed]}
    values = validate_inputs(walk, plain, {k: v for k, v in inputs.items() if k not in streamed})
    if config is not None:
        check_bounds(walk, config, plain, {k: values[k] for k in inputs if k in values})
    whole: dict[str, torch.Tensor | None] = {}
    for name in streamed:
        value = inputs.get(name)
        if value is not None:
            whole[name] = coerce_items(walk, name, declared[name]["type"], value)
        elif streaming:
            whole[name] = None
        else:
            raise RequestError(f"walk '{walk}', input '{name}': missing (the client streams it in: give it whole, "
                               "or submit with streaming=True and feed it)", name)
    return values, whole


def check_submit(walk: str, program: Mapping[str, Any], inputs: Mapping[str, Any], *, streaming: bool,
                 config: Mapping[str, Any], request_id: str | None, timeout: float | None) -> dict[str, Any]:
    """What a client's `submit` checks before the request is queued (`MStar.submit`, the engine
    process client's): `check_inputs`, then `request_id` (None or a non-empty string) and
    `timeout` (None or positive). The values: the typed inputs and the whole streamed ones
    given (a streamed input the client feeds is left out); RequestError naming what is wrong."""
    plain, whole = check_inputs(walk, program, inputs, streaming=streaming, config=config)
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise RequestError("request_id must be a non-empty string", "request_id")
    if timeout is not None and not timeout > 0:
        raise RequestError(f"timeout must be a positive number of seconds, got {timeout!r}", "timeout")
    return {**plain, **{k: v for k, v in whole.items() if v is not None}}


@dataclass(eq=False)
class InputFeed:
    """A streamed walk input of one request: every part the client fed (kept, so that an attempt
    after preemption replays it), whether it is closed, and how far the current attempt has
    moved it into its stream buffer."""

    name: str
    stream: str
    type: Mapping[str, Any]
    parts: list[torch.Tensor] = field(default_factory=list)
    items: int = 0  # fed so far
    closed: bool = False
    whole: bool = False  # given whole at submit
    # ---- the current attempt
    buffer: StreamBuffer | None = None
    part: int = 0  # the next part to push, and how much of it is in already
    offset: int = 0
    pushed: int = 0

    def drained(self) -> bool:
        return self.part == len(self.parts)


def _items(value: Any) -> int:
    """How many items an appended value holds (a tensor: its rows, or 1 for a scalar; a string: its characters)."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else 1
    if isinstance(value, str):
        return len(value)
    return 1


class Listener(Protocol):
    def on_output(self, request: Request, name: str, value: Any) -> None: ...
    def on_finish(self, request: Request) -> None: ...


@dataclass
class RequestStats:
    steps: int = 0
    wasted_steps: int = 0
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was found in the prefix cache (not computed)
    submitted_at: float = 0.0
    first_output_at: float | None = None
    finished_at: float | None = None


@dataclass(eq=False)
class Request:
    """One client request: a walk (and the walks its transitions lead to) over typed inputs."""

    id: str
    walk: str
    inputs: dict[str, Any]
    arrival: int
    host: RequestHost
    listener: Listener | None = None
    deadline: float | None = None
    state: str = WAITING
    error: str | None = None
    error_field: str | None = None
    finish_reason: str | None = None
    outputs: dict[str, Any] = field(default_factory=dict)
    walks_done: list[str] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    # ---- per attempt (reset on preemption)
    tasks: set[WalkTask] = field(default_factory=set)
    buffers: dict[str, StreamBuffer] = field(default_factory=dict)
    appended: dict[str, int] = field(default_factory=dict)
    moved: set[tuple[str, str, str, int]] = field(default_factory=set)  # KV moves done: (walk, step, node@tag, rank)
    homes: dict[tuple[str, str], int] = field(default_factory=dict)  # (node, tag) -> the rank that last wrote it
    # ---- across attempts
    delivered: dict[str, int] = field(default_factory=dict)
    current_walk: str = ""
    current_inputs: dict[str, Any] = field(default_factory=dict)
    feeds: dict[str, InputFeed] = field(default_factory=dict)  # its first walk's streamed inputs

    def awaits_client(self) -> bool:
        """Whether an input of its walk is still open: its tasks may be waiting for the client."""
        return not self.walks_done and any(not f.closed for f in self.feeds.values())

    @property
    def done(self) -> bool:
        return self.state in (FINISHED, FAILED, CANCELLED)

    # ---- effects called by the interpreter
    def emit(self, name: str, value: Any, mode: str) -> None:
        if mode == "set":
            self.outputs[name] = value
            if self.stats.first_output_at is None:
                self.stats.first_output_at = time.perf_counter()
            return
        self.outputs.setdefault(name, []).append(value)
        # Counted in items (a tensor's rows, a string's characters) per walk of the request (a
        # transition starts a new count), so a replay after preemption, which restarts from the
        # first walk, lines up with what was delivered even when it appends the same items in
        # other groups (a decode cohort appends what a row made since its last flush).
        key = f"{len(self.walks_done)}:{name}"
        start = self.appended.get(key, 0)
        end = start + _items(value)
        self.appended[key] = end
        done = self.delivered.get(key, 0)
        if start < done:  # a replay after preemption: the client already has these items
            if end <= done:
                return
            value = value[done - start :]
        self.delivered[key] = end
        if self.stats.first_output_at is None:
            self.stats.first_output_at = time.perf_counter()
        if self.listener is not None:
            self.listener.on_output(self, name, value)

    def push(self, stream_id: str, buffer: StreamBuffer, items: Any) -> None:
        if isinstance(items, torch.Tensor) and items.dim() >= 1 and items.shape[0] == 0:
            return
        buffer.push(items)
        self.host.stream_changed(buffer)

    def stream_closed(self, stream_id: str) -> None:
        self.host.stream_changed(self.buffers[stream_id])

    def wasted_iteration(self, kv_log: KVLog) -> None:
        self.stats.wasted_steps += 1
        self.host.iteration_wasted(self, kv_log)

    def release_context(self, node: str, tag: str) -> None:
        self.host.context_released(self, node, tag)
