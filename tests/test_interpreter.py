"""Direct tests of the walk interpreter (runtime/mstar_runtime/control/interpreter.py), without a conductor.

Each test writes a step program as dicts in the plan's format (docs/plan-format.md), builds
`Interpreter(request, program, buffers).main_task(env)` over a stand-in request that records
the effects the interpreter applies (`emit`, `push`, `stream_closed`, `wasted_iteration`),
and drives the task's generator by hand: it reads what the task yields (`StepCall`,
`WaitChunk`, `WaitSpace`, `Join`, `Spawn`, `ForkKV`) and sends back what the conductor would
(a call's outputs, a chunk, `None`). `readback.Lazy` values with a recording function stand
in for device results, so the tests see exactly when a value is resolved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from mstar_runtime.control.interpreter import (
    ChunkValue,
    ForkKV,
    Frame,
    Interpreter,
    Join,
    Spawn,
    StepCall,
    WaitChunk,
    WaitSpace,
    WalkError,
    WalkTask,
    _Wasted,
    chunk_inputs,
    concat,
    read_flag,
)
from mstar_runtime.control.streams import (
    Chunk,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    StreamBuffer,
)
from mstar_runtime.ops.node import RequestError
from mstar_runtime.ops.readback import Lazy, resolve


# ---------------------------------------------------------------- the stand-in request
@dataclass(eq=False)
class FakeRequest:
    """Records, in order, the calls the interpreter makes on a conductor `Request`."""

    id: str = "r1"
    log: list[tuple[Any, ...]] = field(default_factory=list)

    def emit(self, name: str, value: Any, mode: str) -> None:
        self.log.append(("emit", name, value, mode))

    def push(self, stream_id: str, buffer: StreamBuffer, items: Any) -> None:
        self.log.append(("push", stream_id, items))
        if isinstance(items, torch.Tensor) and items.dim() >= 1 and items.shape[0] == 0:
            return  # as Request.push: an empty push is no push
        buffer.push(items)

    def stream_closed(self, stream_id: str) -> None:
        self.log.append(("closed", stream_id))

    def wasted_iteration(self, kv_log: list[tuple[str, tuple[str, str], int]]) -> None:
        self.log.append(("wasted", list(kv_log)))

    def emits(self, name: str | None = None) -> list[Any]:
        return [e[2] for e in self.log if e[0] == "emit" and (name is None or e[1] == name)]


# ---------------------------------------------------------------- program builders
def var(name: str) -> dict[str, Any]:
    return {"var": name}


def const(value: Any) -> dict[str, Any]:
    return {"const": value}


def call(cid: str, node: str, phase: str, args: dict[str, Any] | None = None,
         results: list[list[str]] | None = None, tag: str | None = None,
         feeds: list[dict[str, str]] | None = None, ranks: list[int] | None = None) -> dict[str, Any]:
    return {"op": "call", "id": cid, "node": node, "phase": phase, "tag": tag, "ranks": ranks or [0],
            "args": args or {}, "results": results or [], "graph": None, "feeds": feeds or []}


def seq(*body: dict[str, Any]) -> dict[str, Any]:
    return {"op": "seq", "body": list(body)}


def emit(output: str, value: dict[str, Any], mode: str = "append") -> dict[str, Any]:
    return {"op": "emit", "output": output, "mode": mode, "value": value}


def acc(name: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"op": "acc", "name": name, "value": value}


def loop(lid: str, body: dict[str, Any], *, count: dict[str, Any] | None = None, max: int | None = None,
         until: str | None = None, index: str | None = None, carry: list[str] | None = None,
         accs: list[str] | None = None) -> dict[str, Any]:
    dynamic = until is not None
    return {"op": "loop", "id": lid, "dynamic": dynamic, "count": count, "max": max, "until": until,
            "index": index, "carry": carry or [], "graph": None, "body": body,
            "acc": [{"name": a, "value": var(a)} for a in accs or []]}


def parallel(pid: str, **branches: dict[str, Any]) -> dict[str, Any]:
    return {"op": "parallel", "id": pid,
            "branches": [{"name": n, "rank": 0, "body": b} for n, b in branches.items()]}


def on_stream(oid: str, stream: str, as_: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"op": "on_stream", "id": oid, "stream": stream, "as": as_, "body": body}


def walk(program: dict[str, Any], streams: list[str] | None = None) -> dict[str, Any]:
    return {"walk": "w", "inputs": [], "outputs": [], "streams": streams or [], "program": program}


# ---------------------------------------------------------------- driving
DONE = object()  # what `send` returns when the generator has finished


def send(task_or_gen: WalkTask | Any, value: Any = None) -> Any:
    gen = task_or_gen.gen if isinstance(task_or_gen, WalkTask) else task_or_gen
    try:
        return gen.send(value)
    except StopIteration:
        return DONE


def start(program: dict[str, Any], env: dict[str, Any] | None = None,
          buffers: dict[str, StreamBuffer] | None = None) -> tuple[FakeRequest, WalkTask, Any, dict[str, Any]]:
    """A main task of `program`, started: (request, task, first yield, env)."""
    req, env = FakeRequest(), dict(env or {})
    task = Interpreter(req, program, buffers or {}).main_task(env)  # type: ignore[arg-type]
    return req, task, send(task), env


class Recorded:
    """Lazy values that record when they are resolved."""

    def __init__(self) -> None:
        self.resolved: list[str] = []

    def __call__(self, name: str, value: Any) -> Lazy:
        def fn() -> Any:
            self.resolved.append(name)
            return value
        return Lazy(fn)


def decode(cid: str = "w.s2", **feeds: str) -> dict[str, Any]:
    """The LM decode call used by most tests: token -> token, done (and code, pushed to `feeds`)."""
    return call(cid, "lm", "decode", {"token": var("token")},
                [["token", "token"], ["done", "done"], ["code", "c"]], tag="main",
                feeds=[{"stream": s, "port": p, "var": "c"} for p, s in feeds.items()])


def tok(v: int) -> torch.Tensor:
    return torch.tensor([v])


# ================================================================ calls, operands, emit
def test_a_seq_of_calls_yields_step_calls_in_order_and_binds_results() -> None:
    encode = call("w.s1", "prompt", "encode", {"text": var("prompt")}, [["tokens", "ids"]])
    prefill = call("w.s2", "lm", "prefill", {"tokens": var("ids"), "max_new": const(3), "bias": const([1, 2])},
                   [["token", "token"], ["done", "done"]], tag="main")
    req, task, y, env = start(walk(seq(encode, prefill)), {"prompt": "hello"})
    assert isinstance(task, WalkTask) and task.name == "main" and task.request is req and not task.done

    assert isinstance(y, StepCall)
    assert y.op is encode and y.request_id == req.id and y.tag is None
    assert y.inputs == {"text": "hello"}
    assert isinstance(y.frame, Frame) and y.frame.request is req
    assert y.seq == 0  # the conductor sets it

    ids = torch.tensor([5, 6, 7])
    y = send(task, {"tokens": ids, "extra": "ignored"})
    assert isinstance(y, StepCall) and y.op is prefill and y.tag == "main"
    assert set(y.inputs) == {"tokens", "max_new", "bias"}
    assert y.inputs["tokens"] is ids  # a bound value, passed on as it is
    assert y.inputs["max_new"] == 3
    assert isinstance(y.inputs["bias"], torch.Tensor) and y.inputs["bias"].tolist() == [1, 2]  # list const

    assert send(task, {"token": tok(1), "done": False, "hidden": None}) is DONE
    assert env["ids"] is ids and env["token"].tolist() == [1] and env["done"] is False
    assert "extra" not in env and "hidden" not in env  # only the named results are bound
    assert req.log == []


def test_lazy_inputs_are_resolved_before_the_call() -> None:
    rec = Recorded()
    _, _, y, _ = start(walk(call("w.s1", "lm", "decode", {"token": var("t")})), {"t": rec("t", tok(4))})
    assert isinstance(y, StepCall) and y.inputs["token"].tolist() == [4]
    assert rec.resolved == ["t"]


def test_an_unbound_operand_fails_the_walk() -> None:
    with pytest.raises(WalkError, match="'ids' is not bound"):
        start(walk(call("w.s1", "lm", "prefill", {"tokens": var("ids")})))


def test_an_unknown_op_fails_the_walk_and_transfer_does_nothing() -> None:
    with pytest.raises(WalkError, match="unknown op 'teleport'"):
        start(walk(seq({"op": "teleport"})))
    req, _, y, _ = start(walk(seq({"op": "transfer", "value": "x", "src": 0, "dst": 1}, emit("o", const(1)))))
    assert y is DONE and req.emits() == [1]


def test_emit_set_and_append() -> None:
    program = seq(emit("tokens", var("a")), emit("tokens", const(2)), emit("flag", const(True), "set"),
                  emit("tokens", const([3, 4])))
    req, _, y, _ = start(walk(program), {"a": 1})
    assert y is DONE
    assert [e[:2] + e[3:] for e in req.log] == [("emit", "tokens", "append"), ("emit", "tokens", "append"),
                                                ("emit", "flag", "set"), ("emit", "tokens", "append")]
    assert req.emits("tokens")[:2] == [1, 2] and req.emits("flag") == [True]
    assert req.emits("tokens")[2].tolist() == [3, 4]


def test_an_acc_outside_a_loop_fails_the_walk() -> None:
    with pytest.raises(WalkError, match="acc traj outside of a loop"):
        start(walk(seq(acc("traj", const(1)))))


# ================================================================ Loop(n)
def flow_loop(count: dict[str, Any], max: int | None = 8) -> dict[str, Any]:
    body = seq(call("w.s6", "flow", "step", {"x": var("x"), "index": var("i")}, [["x", "x"], ["v", "v"]]),
               acc("traj", var("x")))
    return loop("w.l1", body, count=count, max=max, index="i", carry=["x"], accs=["traj"])


def test_loop_runs_count_iterations_with_index_carry_and_acc() -> None:
    program = seq(flow_loop(var("steps")), emit("latent", var("x"), "set"), emit("trajectory", var("traj"), "set"))
    x0 = torch.zeros(1, 2)
    req, task, y, env = start(walk(program), {"steps": 3, "x": x0})
    outs = [torch.full((1, 2), float(k)) for k in (1, 2, 3)]
    for i, out in enumerate(outs):
        assert isinstance(y, StepCall) and y.op["id"] == "w.s6"
        assert y.inputs["index"] == i
        assert y.inputs["x"] is (x0 if i == 0 else outs[i - 1])  # carried from the previous iteration
        assert isinstance(y.frame, Frame) and y.frame.accs == {"traj": outs[:i]}
        y = send(task, {"x": out, "v": -i})
    assert y is DONE
    assert env["x"] is outs[-1]  # carried out of the loop
    assert torch.equal(env["traj"], torch.cat(outs))  # acc: concatenated along dim 0
    assert "i" not in env and "v" not in env  # the index and uncarried names stay in the body
    assert req.emits("latent")[0] is outs[-1]
    assert torch.equal(req.emits("trajectory")[0], torch.cat(outs))


def test_loop_count_may_be_a_tensor() -> None:
    _, task, y, _ = start(walk(flow_loop(var("steps"))), {"steps": torch.tensor(2), "x": tok(0)})
    n = 0
    while isinstance(y, StepCall):
        n += 1
        y = send(task, {"x": tok(n), "v": 0})
    assert n == 2 and y is DONE


def test_a_loop_of_zero_iterations_accumulates_an_empty_tensor() -> None:
    x0 = tok(0)
    _, _, y, env = start(walk(flow_loop(const(0))), {"x": x0})
    assert y is DONE
    assert env["x"] is x0
    assert isinstance(env["traj"], torch.Tensor) and env["traj"].numel() == 0


@pytest.mark.parametrize(("steps", "max", "bound"), [(9, 8, "0..8"), (-1, 8, "0..8"), (-1, None, ">= 0")])
def test_a_loop_count_out_of_bounds_names_the_input(steps: int, max: int | None, bound: str) -> None:
    with pytest.raises(RequestError) as err:
        start(walk(flow_loop(var("steps"), max=max)), {"steps": steps, "x": tok(0)})
    assert err.value.field == "steps"
    assert str(err.value) == f"'steps' = {steps} is outside {bound} (the bound of loop w.l1)"


def test_a_loop_count_at_its_bound_runs() -> None:
    _, task, y, _ = start(walk(flow_loop(var("steps"), max=2)), {"steps": 2, "x": tok(0)})
    assert isinstance(y, StepCall)
    assert isinstance(send(task, {"x": tok(1), "v": 0}), StepCall)
    assert send(task, {"x": tok(2), "v": 0}) is DONE


# ================================================================ DynamicLoop
def chat(max: int = 8, before: list[dict[str, Any]] | None = None, after: list[dict[str, Any]] | None = None,
         accs: list[str] | None = None, handoff: bool = True) -> dict[str, Any]:
    """`dynamic_loop max until done carry token, done { <before>; token, done = lm.decode(token); <after> }`,
    then `emit handoff = done` (unless `handoff` is false)."""
    body = seq(*(before or []), decode(), *(after or []))
    tail = [emit("handoff", var("done"), "set")] if handoff else []
    return walk(seq(loop("w.l1", body, max=max, until="done", carry=["token", "done"], accs=accs), *tail))


def test_a_dynamic_loop_issues_the_next_iteration_before_reading_the_flag() -> None:
    rec = Recorded()
    req, task, y, env = start(chat(after=[emit("tokens", var("token"))]), {"token": tok(0)})
    assert isinstance(y, StepCall) and y.inputs["token"].tolist() == [0]
    assert not y.frame.speculative  # no flag before the loop: iteration 0 is not speculative

    y = send(task, {"token": tok(1), "done": rec("done0", False), "code": None})
    assert isinstance(y, StepCall) and y.inputs["token"].tolist() == [1]  # iteration 1 ...
    assert rec.resolved == []  # ... issued before iteration 0's flag was read
    assert y.frame.speculative

    y = send(task, {"token": tok(2), "done": rec("done1", False), "code": None})
    assert rec.resolved == ["done0"]  # read once iteration 1's first call came back
    assert isinstance(y, StepCall) and y.inputs["token"].tolist() == [2]
    assert [t.tolist() for t in req.emits("tokens")] == [[1], [2]]
    assert env["token"].tolist() == [2]  # iterations 0 and 1 have ended: their carries are in
    assert rec.resolved == ["done0"]  # carrying a flag does not read it


def test_a_stop_flag_wastes_the_speculative_iteration() -> None:
    """Iteration 1 says stop; iteration 2 was already issued: its KV appends are handed to
    `wasted_iteration`, its effects (emit, acc, carry) never happen, those of iteration 1 do."""
    rec = Recorded()
    program = chat(after=[emit("tokens", var("token")), acc("states", var("token"))], accs=["states"])
    program["program"]["body"].append(emit("states", var("states"), "set"))
    req, task, y, env = start(program, {"token": tok(0)})
    for i in range(3):  # the conductor logs each KV reservation on the call's frame
        assert isinstance(y, StepCall)
        y.frame.log_kv("lm", (req.id, "main"), 10 + i)
        done = [False, True, False][i]
        token = rec(f"token{i + 1}", tok(i + 1)) if i == 1 else tok(i + 1)  # a lazy token too
        y = send(task, {"token": token, "done": done, "code": None})
    assert y is DONE
    assert req.log.count(("wasted", [("lm", ("r1", "main"), 12)])) == 1  # iteration 2's append only
    assert [t.tolist() for t in req.emits("tokens")] == [[1], [2]]  # iteration 2's token is dropped
    assert rec.resolved == ["token2"]  # the kept iteration's lazy emit was applied
    assert resolve(env["token"]).tolist() == [2] and env["done"] is True  # carried from iteration 1
    assert req.emits("handoff") == [True]
    assert req.emits("states")[0].tolist() == [1, 2]
    wasted_at = next(i for i, e in enumerate(req.log) if e[0] == "wasted")
    assert [e[0] for e in req.log[wasted_at + 1:]] == ["emit", "emit"]  # handoff, states: after the loop


def test_effects_before_an_iterations_first_call_wait_for_the_previous_flag() -> None:
    req, task, y, _ = start(chat(before=[emit("marks", const("m"))]), {"token": tok(0), "done": False})
    assert isinstance(y, StepCall) and y.frame.speculative  # a flag bound before the loop: speculative
    assert req.emits("marks") == []  # held back until the prefill's flag is read
    y = send(task, {"token": tok(1), "done": False, "code": None})
    assert req.emits("marks") == ["m"]
    assert isinstance(y, StepCall) and req.emits("marks") == ["m"]  # iteration 1's mark: held again
    assert send(task, {"token": tok(2), "done": True, "code": None}) is not DONE
    assert req.emits("marks") == ["m", "m"]


def test_a_flag_bound_before_the_loop_is_honoured() -> None:
    """A prefill that already said done: iteration 0 is issued, then wasted; nothing of it stays."""
    rec = Recorded()
    req, task, y, env = start(chat(before=[emit("marks", const("m"))], after=[emit("tokens", var("token"))]),
                              {"token": tok(0), "done": rec("prefill", True)})
    assert isinstance(y, StepCall) and rec.resolved == []
    y.frame.log_kv("lm", (req.id, "main"), 4)
    assert send(task, {"token": tok(1), "done": False, "code": None}) is DONE
    assert rec.resolved == ["prefill"]
    assert req.log[0] == ("wasted", [("lm", ("r1", "main"), 4)])
    assert req.emits("marks") == [] and req.emits("tokens") == []
    assert env["token"].tolist() == [0]
    assert req.emits("handoff") == [True]  # the prefill's flag, resolved by the emit


def test_a_dynamic_loop_stops_at_max_without_reading_the_last_flag() -> None:
    rec = Recorded()
    req, task, y, env = start(chat(max=3, handoff=False), {"token": tok(0)})
    calls = 0
    while isinstance(y, StepCall):
        y = send(task, {"token": tok(calls + 1), "done": rec(f"done{calls}", False), "code": None})
        calls += 1
    assert y is DONE and calls == 3
    assert rec.resolved == ["done0", "done1"]  # iteration 2's flag is never needed
    assert not any(e[0] == "wasted" for e in req.log)
    assert env["token"].tolist() == [3]


def test_a_wasted_outer_iteration_abandons_its_inner_loop() -> None:
    """The outer flag is resolved before the inner one, and the `_Wasted` of the outer iteration
    passes through the inner loop: one wasted iteration, the outer one, with the inner call's KV."""
    inner = loop("w.l2", seq(call("w.s3", "lm", "decode", {}, [["d", "d"], ["stop", "stop"]], tag="main")),
                 max=2, until="d", carry=["stop"])
    program = walk(loop("w.l1", seq(inner), max=4, until="stop", carry=["stop"]))
    req, task, y, env = start(program, {})
    assert isinstance(y, StepCall)
    y = send(task, {"d": False, "stop": False})  # outer 0, inner 0
    assert isinstance(y, StepCall)
    y = send(task, {"d": True, "stop": True})  # outer 0, inner 1 (speculative on d=False): stop
    assert isinstance(y, StepCall)  # outer 1 (speculative on stop=True), inner 0
    assert y.frame.parent is not None and y.frame.parent.speculative
    y.frame.log_kv("lm", (req.id, "main"), 9)
    assert send(task, {"d": False, "stop": False}) is DONE
    assert req.log == [("wasted", [("lm", ("r1", "main"), 9)])]
    assert env["stop"] is True


def test_wasted_raised_in_a_frame_chain_resolves_outer_iterations_first() -> None:
    req = FakeRequest()
    outer = Frame(req, pending_flag=True)  # type: ignore[arg-type]
    inner = Frame(req, parent=Frame(req, parent=outer), pending_flag=torch.tensor([1]))  # type: ignore[arg-type]
    with pytest.raises(_Wasted) as err:
        inner.after_first_step()
    assert err.value.frame is outer
    assert inner.speculative  # never reached


# ================================================================ parallel
def test_parallel_yields_a_join_of_child_tasks_with_their_own_lanes() -> None:
    text = seq(call("w.s1", "prompt", "encode", {"text": var("prompt")}, [["tokens", "ids"]]),
               emit("order", const("text")))
    neg = seq(call("w.s2", "prompt", "encode", {"text": var("negative")}, [["tokens", "neg_ids"]]),
              emit("order", var("n")))
    after = call("w.s4", "lm", "prefill", {"a": var("ids"), "b": var("neg_ids")})
    req, task, y, env = start(walk(seq(parallel("w.p1", text=text, neg=neg), after)),
                              {"prompt": "p", "negative": "n", "n": 1})
    assert isinstance(y, Join)
    assert [t.name for t in y.tasks] == ["text", "neg"]
    assert all(isinstance(t, WalkTask) and t.request is req and t.parent is None for t in y.tasks)
    a, b = (send(t) for t in y.tasks)
    assert isinstance(a, StepCall) and a.inputs == {"text": "p"}
    assert isinstance(b, StepCall) and b.inputs == {"text": "n"}
    assert a.frame.lane is not b.frame.lane  # each branch its own lane ...
    assert a.frame.parent is b.frame.parent and a.frame.parent is not None
    assert a.frame.lane is not a.frame.parent.lane  # ... not the parent's
    ids, neg_ids = tok(1), tok(2)
    assert send(y.tasks[1], {"tokens": neg_ids}) is DONE  # the second branch may finish first
    assert send(y.tasks[0], {"tokens": ids}) is DONE
    assert req.emits("order") == [1, "text"]  # `n`: a value of the walk's env, seen by the branch
    y = send(task)  # the conductor resumes the parent when every child has ended
    assert isinstance(y, StepCall) and y.inputs["a"] is ids and y.inputs["b"] is neg_ids
    assert env["ids"] is ids and env["neg_ids"] is neg_ids  # fan-in: the branches' names


def test_a_branch_lane_is_flushed_when_the_branch_ends() -> None:
    rec = Recorded()
    branch = seq(call("w.s1", "lm", "decode", {}, [["token", "t"]]), emit("tokens", var("t")))
    req, _, y, _ = start(walk(parallel("w.p1", only=branch)))
    child = y.tasks[0]
    assert send(child) is not DONE
    assert send(child, {"token": rec("t", tok(7))}) is DONE
    assert rec.resolved == ["t"] and [t.tolist() for t in req.emits("tokens")] == [[7]]


# ================================================================ streams
def test_on_stream_blocks_are_spawned_at_the_start_wherever_they_are_written() -> None:
    block = on_stream("w.o1", "s", "w", seq(call("w.s4", "codec", "decode_window", {"window": var("w")})))
    nested = on_stream("w.o2", "t", "x", seq(emit("x", var("x"))))
    program = walk(seq(decode(code="s"), loop("w.l1", seq(nested), count=const(1)), block), streams=["s", "t"])
    buffers = {sid: StreamBuffer(FixedChunkPolicy(2), 4) for sid in ("s", "t")}
    req, task, y, _ = start(program, {"token": tok(0)}, buffers)
    spawned = []
    while isinstance(y, Spawn):
        spawned.append(y.task)
        y = send(task)
    assert [t.name for t in spawned] == ["w.o2", "w.o1"]  # pre-order: the nested one first
    assert all(isinstance(t, WalkTask) and t.request is req for t in spawned)
    assert isinstance(y, StepCall) and y.op["id"] == "w.s2"  # then the main body
    first = send(spawned[1])
    assert isinstance(first, WaitChunk) and first.buffer is buffers["s"]
    assert send(spawned[0]).buffer is buffers["t"]


def test_a_stream_block_runs_its_body_per_chunk_until_the_stream_ends() -> None:
    body = seq(call("w.s4", "codec", "decode_window", {"window": var("w"), "n": var("n")}, [["pcm", "pcm"]]),
               emit("audio", var("pcm")))
    buffer = StreamBuffer(LeftContextChunkPolicy(chunk=2, left=1), 8)
    req, task, y, _ = start(walk(on_stream("w.o1", "s", "w", body), streams=["s"]), {"n": 3}, {"s": buffer})
    assert isinstance(y, Spawn)
    block = y.task
    buffer.push(torch.tensor([10, 11, 12, 13, 14]))  # what the producer pushed meanwhile
    chunks = buffer.pop_ready()
    assert send(task) is DONE  # the main body has nothing else to do: the stream closes
    assert buffer.closed and req.log == [("closed", "s")]
    chunks += buffer.pop_ready()  # the final partial chunk, released by the close
    assert [(c.items.tolist(), c.context, c.final) for c in chunks] == [
        ([10, 11], 0, False), ([11, 12, 13], 1, False), ([13, 14], 1, True)]

    y = send(block)
    for k, chunk in enumerate(chunks):
        assert isinstance(y, WaitChunk) and y.buffer is buffer
        y = send(block, chunk)
        assert isinstance(y, StepCall) and y.op["id"] == "w.s4" and y.inputs["n"] == 3
        window = y.inputs["window"]
        assert isinstance(window, ChunkValue) and window.chunk is chunk
        assert chunk_inputs(y.inputs) == {"window": chunk.items, "window:context": chunk.context,
                                          "window:final": chunk.final, "n": 3}
        y = send(block, {"pcm": torch.tensor([float(k)])})
    assert isinstance(y, WaitChunk)
    assert send(block, None) is DONE  # the stream is done
    assert [p.tolist() for p in req.emits("audio")] == [[0.0], [1.0], [2.0]]


def test_feeds_push_the_outputs_and_the_walk_closes_its_streams() -> None:
    buffer = StreamBuffer(FixedChunkPolicy(2), 4)
    program = walk(loop("w.l1", seq(decode(code="s")), count=const(2), carry=["token"]), streams=["s"])
    req, task, y, _ = start(program, {"token": tok(0)}, {"s": buffer})
    y = send(task, {"token": tok(1), "done": False, "code": torch.tensor([7])})
    assert req.log == [("push", "s", req.log[0][2])] and req.log[0][2].tolist() == [7]
    assert isinstance(y, StepCall)
    assert send(task, {"token": tok(2), "done": False, "code": torch.tensor([8, 9])}) is DONE
    assert [e[0] for e in req.log] == ["push", "push", "closed"]
    assert buffer.pushed == 3 and buffer.closed


def test_a_full_buffer_makes_the_producer_wait_for_space() -> None:
    buffer = StreamBuffer(FixedChunkPolicy(2), 2)
    buffer.push(torch.tensor([1, 2]))  # full: the consumer has not taken the chunk
    _, task, y, _ = start(walk(decode(code="s"), streams=["s"]), {"token": tok(0)}, {"s": buffer})
    assert isinstance(y, WaitSpace) and y.buffer is buffer and y.items == 1
    assert isinstance(send(task), WaitSpace)  # resumed while still full: waits again
    assert len(buffer.pop_ready()) == 1  # the consumer takes the chunk
    y = send(task)
    assert isinstance(y, StepCall) and y.op["id"] == "w.s2"


def test_the_lane_is_flushed_before_waiting_for_space() -> None:
    """A lazy emit queued on the lane is applied before the task waits for stream space."""
    rec = Recorded()
    buffer = StreamBuffer(FixedChunkPolicy(2), 2)
    program = walk(seq(call("w.s1", "lm", "decode", {}, [["token", "t"]]), emit("tokens", var("t")),
                       decode(code="s")), streams=["s"])
    req, task, y, _ = start(program, {"token": tok(0)}, {"s": buffer})
    buffer.push(torch.tensor([1, 2]))
    y = send(task, {"token": rec("t", tok(5))})
    assert isinstance(y, WaitSpace)
    assert rec.resolved == ["t"] and [t.tolist() for t in req.emits("tokens")] == [[5]]


def test_a_lazy_push_queued_on_the_lane_never_overfills_the_buffer() -> None:
    """Producer steps whose pushes are lazy (Orpheus' and the test family's `code`, one item a
    step) into a buffer of capacity 2 whose consumer takes nothing: the producer must end up
    waiting for space (WaitSpace) with at most 2 items in the buffer."""
    buffer = StreamBuffer(FixedChunkPolicy(2), 2)
    program = walk(loop("w.l1", seq(decode(code="s")), count=const(6), carry=["token"]), streams=["s"])
    _, task, y, _ = start(program, {"token": tok(0)}, {"s": buffer})
    for k in range(6):
        if not isinstance(y, StepCall):
            break
        y = send(task, {"token": tok(k), "done": False, "code": Lazy(lambda k=k: torch.tensor([k]))})
    assert isinstance(y, WaitSpace)
    assert buffer.pending <= buffer.capacity


# ================================================================ fork
def test_fork_yields_fork_kv_after_flushing_the_lane() -> None:
    rec = Recorded()
    program = walk(seq(call("w.s1", "lm", "prefill", {}, [["token", "t"]], tag="uncond"), emit("tokens", var("t")),
                       {"op": "fork", "node": "lm", "src": "uncond", "dst": "cond"},
                       call("w.s2", "lm", "prefill", {}, tag="cond")))
    req, task, y, _ = start(program)
    y = send(task, {"token": rec("t", tok(1))})
    assert isinstance(y, ForkKV) and (y.node, y.src, y.dst) == ("lm", "uncond", "cond")
    assert rec.resolved == ["t"] and len(req.emits("tokens")) == 1
    y = send(task)  # the conductor resumes the task once the fork is done
    assert isinstance(y, StepCall) and y.tag == "cond"


# ================================================================ lanes
def two_calls(*between: dict[str, Any], after: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return walk(seq(call("w.s1", "lm", "decode", {}, [["token", "a"]]), *between,
                    call("w.s2", "lm", "decode", {}, [["token", "b"]]), *(after or [])))


def test_a_lazy_emit_is_applied_when_the_next_step_call_comes_back() -> None:
    rec = Recorded()
    req, task, y, _ = start(two_calls(emit("tokens", var("a")), after=[emit("tokens", var("b"))]))
    y = send(task, {"token": rec("a", tok(1))})
    assert isinstance(y, StepCall) and y.op["id"] == "w.s2"
    assert rec.resolved == [] and req.log == []  # queued on the lane while the next call is issued
    assert send(task, {"token": tok(2)}) is DONE
    assert rec.resolved == ["a"]
    assert [t.tolist() for t in req.emits("tokens")] == [[1], [2]]


def test_a_plain_value_is_applied_at_once_when_the_lane_is_empty() -> None:
    req, task, _, _ = start(two_calls(emit("tokens", var("a"))))
    y = send(task, {"token": tok(1)})
    assert isinstance(y, StepCall) and [t.tolist() for t in req.emits("tokens")] == [[1]]


def test_effects_behind_a_lazy_one_keep_their_order() -> None:
    rec = Recorded()
    req, task, _, _ = start(two_calls(emit("tokens", var("a")), emit("tokens", const(9)), emit("flag", const(1), "set")))
    y = send(task, {"token": rec("a", tok(1))})
    assert isinstance(y, StepCall) and req.log == []  # the plain emits queue behind the lazy one
    send(task, {"token": tok(2)})
    assert [e[1] for e in req.log] == ["tokens", "tokens", "flag"]
    assert req.log[0][2].tolist() == [1] and req.log[1][2] == 9


def test_the_lane_is_flushed_at_the_end_of_the_walk_before_its_streams_close() -> None:
    rec = Recorded()
    buffer = StreamBuffer(FixedChunkPolicy(2), 4)
    program = walk(seq(decode(code="s"), emit("tokens", var("token"))), streams=["s"])
    req, task, _, _ = start(program, {"token": tok(0)}, {"s": buffer})
    assert send(task, {"token": rec("token", tok(1)), "done": False, "code": rec("code", torch.tensor([3]))}) is DONE
    assert rec.resolved == ["code", "token"]  # the push first: effects keep their order
    assert [e[0] for e in req.log] == ["push", "emit", "closed"]
    assert buffer.pushed == 1


def test_the_lane_is_flushed_at_the_end_of_a_loop() -> None:
    rec = Recorded()
    body = seq(call("w.s1", "lm", "decode", {}, [["token", "t"]]), emit("tokens", var("t")))
    program = walk(seq(loop("w.l1", body, count=const(2)), call("w.s2", "lm", "finish")))
    req, task, _, _ = start(program)
    assert isinstance(send(task, {"token": rec("t0", tok(0))}), StepCall)
    assert rec.resolved == []
    y = send(task, {"token": rec("t1", tok(1))})  # iteration 0's emit applied; iteration 1's at the loop's end
    assert isinstance(y, StepCall) and y.op["id"] == "w.s2"
    assert rec.resolved == ["t0", "t1"]
    assert [t.tolist() for t in req.emits("tokens")] == [[0], [1]]


def test_the_lane_is_flushed_before_a_join() -> None:
    rec = Recorded()
    program = walk(seq(call("w.s1", "lm", "decode", {}, [["token", "t"]]), emit("tokens", var("t")),
                       parallel("w.p1", a=seq(emit("x", const(1))))))
    req, task, _, _ = start(program)
    y = send(task, {"token": rec("t", tok(3))})
    assert isinstance(y, Join)
    assert rec.resolved == ["t"] and len(req.emits("tokens")) == 1


def test_a_lazy_flag_and_lazy_emit_in_a_dynamic_loop() -> None:
    """Orpheus' decode loop on the GPU: token and done lazy. Each is resolved one step late, the
    emits keep their order, and the flag that stops the loop is read after the wasted step."""
    rec = Recorded()
    req, task, y, _ = start(chat(after=[emit("tokens", var("token"))]), {"token": tok(0)})
    for i in range(3):
        assert isinstance(y, StepCall)
        y = send(task, {"token": rec(f"t{i}", tok(i + 1)), "done": rec(f"d{i}", i == 1), "code": None})
    assert y is DONE
    assert rec.resolved == ["t0", "d0", "t1", "d1"]  # t2 and d2 belong to the wasted iteration
    assert [t.tolist() for t in req.emits("tokens")] == [[1], [2]]
    assert sum(e[0] == "wasted" for e in req.log) == 1


# ================================================================ helpers
@pytest.mark.parametrize(("value", "expected"), [
    (True, True), (False, False), (0, False), (1, True),
    (torch.tensor(True), True), (torch.tensor([0]), False), (torch.tensor([[1, 0]]), True),
    (torch.tensor([0, 1]), False),  # the first item decides
    (torch.zeros(0), False),  # an empty tensor: no stop
])
def test_read_flag(value: Any, expected: bool) -> None:
    assert read_flag(value) is expected


def test_read_flag_resolves_a_lazy_value() -> None:
    rec = Recorded()
    assert read_flag(rec("f", torch.tensor([1]))) is True
    assert rec.resolved == ["f"]
    with pytest.raises(TypeError):  # a Lazy is never truthy by accident
        bool(Lazy(lambda: False))


def test_concat() -> None:
    empty = concat([])
    assert isinstance(empty, torch.Tensor) and empty.shape == (0,)
    assert concat(["ab", "c", ""]) == "abc"
    assert concat([1, 2, 3]).tolist() == [1, 2, 3]  # scalars stacked
    assert concat([torch.tensor(1.5), torch.tensor(2.5)]).tolist() == [1.5, 2.5]
    assert concat([torch.tensor([1, 2]), torch.tensor([3])]).tolist() == [1, 2, 3]  # dim 0
    assert concat([torch.ones(1, 2), torch.zeros(2, 2)]).shape == (3, 2)
    assert concat([torch.tensor(1), torch.tensor([2])]).tolist() == [1, 2]  # a scalar among items: stacked
    assert concat([Lazy(lambda: torch.tensor([4])), torch.tensor([5])]).tolist() == [4, 5]
    assert concat([Lazy(lambda: "x"), "y"]) == "xy"


def test_chunk_inputs() -> None:
    chunk = Chunk(index=3, items=torch.tensor([1, 2, 3]), context=1, final=True, start=5)
    plain = torch.tensor([9])
    out = chunk_inputs({"codes": ChunkValue(chunk), "other": plain, "n": 2})
    assert out == {"codes": chunk.items, "codes:context": 1, "codes:final": True, "other": plain, "n": 2}
    assert out["codes"] is chunk.items and out["other"] is plain
    assert chunk_inputs({}) == {}


def test_a_speculative_frame_defers_effects_until_its_flag_is_read() -> None:
    req = FakeRequest()
    parent = Frame(req)  # type: ignore[arg-type]
    frame = Frame(req, parent=parent, pending_flag=False)  # type: ignore[arg-type]
    assert frame.lane is parent.lane  # shared with the parent unless given
    done: list[int] = []
    effects: list[Callable[[], None]] = [lambda: done.append(1), lambda: done.append(2)]
    for fn in effects:
        frame.effect(fn)
    assert done == [] and len(frame.deferred) == 2
    frame.after_first_step()
    assert done == [1, 2] and not frame.speculative and frame.deferred == []
    frame.effect(lambda: done.append(3))  # no longer speculative: at once
    assert done == [1, 2, 3]
    frame.log_kv("lm", ("r1", "main"), 2)
    assert frame.kv_log == parent.kv_log == [("lm", ("r1", "main"), 2)]
