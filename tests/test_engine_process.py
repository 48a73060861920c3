"""`mstar-run PLAN --serve --engine-process`: the engine in its own process.

The same seeded requests give the same bytes in process and with the engine in a child
process (the test family's routes, Orpheus tiny's speech); a client that hangs up cancels its
request in the engine; a killed engine process gives 503s that say so (not "the engine thread
stopped") and leaves no orphan; a value the wire cannot carry is the request's error; SIGTERM
drains; large tensors pass through shared memory and the reader unlinks the block.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
pytest.importorskip("uvicorn", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")

from test_server_support import (  # noqa: E402
    ROOT,
    Reader,
    Server,
    compile_plan,
    get,
    metric,
    ndjson_lines,
    open_stream,
    post,
    read_all,
    send_request,
    serving,
    wait_for,
)

from mstar_runtime.engine_process import SHM_BYTES, from_value, to_value  # noqa: E402
from mstar_runtime.worker import messages as m  # noqa: E402

LONG = 1_000_000  # steps of `slow` that no test waits for


VARYING = ("stats", "id", "created", "usage_s")  # timings and ids: not part of the answer


def _strip(v: object) -> object:
    if isinstance(v, dict):
        return {k: _strip(x) for k, x in v.items() if k not in VARYING}
    if isinstance(v, list):
        return [_strip(x) for x in v]
    return v


def _answer(raw: bytes) -> object:
    """A response body without its timings and ids: JSON, NDJSON lines, or the raw bytes (audio)."""
    try:
        return [_strip(json.loads(line)) for line in raw.splitlines() if line.strip()]
    except (ValueError, UnicodeDecodeError):
        return raw


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_plan(tmp_path_factory.mktemp("engine_process"))


@pytest.fixture(scope="module")
def both(plan: Path) -> Iterator[tuple[Server, Server]]:
    with serving(plan) as inproc, serving(plan, "--engine-process") as child:
        yield inproc, child


def test_values_through_shared_memory() -> None:
    """In a process of its own: the first SharedMemory starts multiprocessing's resource tracker,
    a child that would outlive the test in this process (other tests check for leftover children)."""
    import subprocess
    import sys

    code = "import sys; sys.path.insert(0, 'tests'); from test_engine_process import _shared_memory_round_trip; " \
           "_shared_memory_round_trip()"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def _shared_memory_round_trip() -> None:
    small = torch.arange(6, dtype=torch.int32)
    v = m.decode(m.encode(m.EngineOutput("r", 0, "tokens", to_value(small)))).value  # type: ignore[union-attr]
    assert v.shm is None and torch.equal(from_value(v), small)
    big = torch.randn(SHM_BYTES // 4 + 3, dtype=torch.float32)
    v = m.decode(m.encode(m.EngineOutput("r", 1, "audio", to_value(big)))).value  # type: ignore[union-attr]
    assert v.shm is not None and v.tensor is None
    assert Path(f"/dev/shm/{v.shm.name}").exists()
    assert torch.equal(from_value(v), big)
    assert not Path(f"/dev/shm/{v.shm.name}").exists()  # the reader unlinked it
    bf = torch.randn(SHM_BYTES, dtype=torch.bfloat16)
    assert torch.equal(from_value(m.decode(m.encode(m.EngineOutput("r", 2, "x", to_value(bf)))).value), bf)
    assert from_value(m.decode(m.encode(m.EngineOutput("r", 3, "t", to_value("héllo")))).value) == "héllo"


def test_same_answers_as_in_process(both: tuple[Server, Server]) -> None:
    inproc, child = both
    assert len(child.children()) == 1 and not inproc.children()
    requests = [
        ("/v1/walks/chat", {"inputs": {"prompt": "hello there", "max_new": 6}, "stream": False}),
        ("/v1/walks/chat", {"inputs": {"prompt": "hello there", "max_new": 6}}),
        ("/v1/walks/slow", {"inputs": {"steps": 5}}),
        ("/v1/chat/completions", {"model": "testfamily", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 5, "seed": 3}),
        ("/v1/audio/speech", {"model": "testfamily", "input": "say this", "voice": "a", "response_format": "pcm",
                              "seed": 2}),
        ("/v1/walks/chat", {"inputs": {"prompt": 7}}),  # a 400, in the same words
    ]
    for path, body in requests:
        a, b = post(inproc.base + path, body), post(child.base + path, body)
        assert a[0] == b[0], (path, a, b)
        assert _answer(a[1]) == _answer(b[1]), (path, a[1][:300], b[1][:300])
    assert get(child.base + "/health") == (200, get(inproc.base + "/health")[1])


def test_disconnect_cancels_in_the_engine(both: tuple[Server, Server]) -> None:
    base = both[1].base
    s = open_stream(base, "/v1/walks/slow", {"inputs": {"steps": LONG}})
    wait_for(lambda: metric(base, "mstar_kv_pages_in_use") >= 1, 30, "the slow request to hold KV pages")
    s.close()
    wait_for(lambda: metric(base, "mstar_kv_pages_in_use") == 0 and metric(base, "mstar_requests_active") == 0,
             30, "the engine to cancel the disconnected request")
    assert metric(base, "mstar_requests_total", 'walk="slow",outcome="cancelled"') == 1
    assert post(base + "/v1/walks/slow", {"inputs": {"steps": 3}, "stream": False})[0] == 200


def test_killed_engine_gives_503_and_no_orphan(plan: Path) -> None:
    with serving(plan, env={"MSTAR_ENGINE_PROCESS": "1"}) as server:
        base = server.base
        (engine,) = server.children()
        s = open_stream(base, "/v1/walks/slow", {"inputs": {"steps": LONG}})
        wait_for(lambda: metric(base, "mstar_kv_pages_in_use") >= 1, 30, "the slow request to run")
        os.kill(engine, signal.SIGKILL)
        lines = ndjson_lines(read_all(s, 60))
        assert lines[-1]["type"] == "error" and lines[-1]["error"]["code"] == "engine_unavailable"
        assert str(engine) not in json.dumps(lines[-1])  # the pid is for the log
        status, raw = get(base + "/health")
        health = json.loads(raw)
        assert status == 503 and health["status"] == "unhealthy"
        # a process, not the in-process engine thread, stopped: say which
        assert health["error"] == "the engine process stopped", health
        status, raw = post(base + "/v1/walks/chat", {"inputs": {"prompt": "x"}})
        err = json.loads(raw)["error"]
        assert status == 503 and err["code"] == "engine_unavailable" and "engine process stopped" in err["message"]
        assert "thread" not in err["message"], err
        assert server.terminate(30) == 0
    assert not _alive(engine)


def test_a_value_the_wire_cannot_carry_is_the_requests_error(plan: Path) -> None:
    """Text that is not valid Unicode cannot be written as msgpack: a RequestError naming the
    input (a 400), where it once was taken for a dead pipe (a 503 "the engine is closed")."""
    from mstar_runtime.engine_process import EngineClient
    from mstar_runtime.ops.node import RequestError
    from mstar_runtime.plan.loader import load_plan

    client = EngineClient.start(load_plan(plan), plan, {"weights": "init"})
    try:
        with pytest.raises(RequestError, match="cannot be sent to the engine process") as info:
            client.submit("chat", {"prompt": "a\ud800b"})
        assert info.value.field == "prompt"
        assert client.engine_fault() is None
        out = client.submit("chat", {"prompt": "x", "max_new": 2}).result()  # the engine still serves
        assert out["tokens"].numel() >= 1
    finally:
        client.close()


def test_engine_exits_with_its_api_process(plan: Path) -> None:
    """SIGKILL of the API process (no drain, no Shutdown): the engine sees its socket close and exits."""
    with serving(plan, "--engine-process") as server:
        (engine,) = server.children()
        server.proc.kill()
        server.proc.wait(30)
        wait_for(lambda: not _alive(engine), 30, "the engine process to exit after its API process died")


def test_sigterm_drains(plan: Path) -> None:
    """SIGTERM: admission stops, the request in flight finishes, the engine process exits."""
    with serving(plan, "--engine-process", "--shutdown-timeout", "60") as server:
        base = server.base
        (engine,) = server.children()
        slow = Reader(send_request(base, "/v1/walks/slow", {"inputs": {"steps": 300}}))
        wait_for(lambda: metric(base, "mstar_kv_pages_in_use") >= 1, 30, "the request to run")
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: get(base + "/health")[0] == 503, 10, "/health to report draining")
        lines = ndjson_lines(slow.result(60))
        assert lines[-1]["type"] == "done" and len(lines) == 301, lines[-1]
        assert server.proc.wait(30) == 0
    wait_for(lambda: not _alive(engine), 10, "the engine process to exit")


def test_orpheus_speech_bytes_equal(tmp_path: Path) -> None:
    from mstarc.cli import main as mstarc

    plan = tmp_path / "orpheus-tiny.plan"
    assert mstarc(["compile", str(ROOT / "models/orpheus/orpheus.walk"), "--variant", "tiny", "-p",
                   str(ROOT / "placements/cpu.yaml"), "-o", str(plan)]) == 0
    body = {"model": "orpheus", "voice": "tara", "input": "Hello from M star.", "max_tokens": 60, "seed": 1}
    out = []
    # seeded random weights: `init` (the nodes' own initialisation) differs from process to process
    for args in (("--weights", "dummy"), ("--weights", "dummy", "--engine-process")):
        with serving(plan, *args) as server:
            out.append((post(server.base + "/v1/audio/speech", {**body, "response_format": "wav"}),
                        post(server.base + "/v1/audio/speech", {**body, "response_format": "pcm", "stream": True})))
    (wav_a, pcm_a), (wav_b, pcm_b) = out
    assert wav_a[0] == wav_b[0] == 200 and pcm_a[0] == pcm_b[0] == 200
    assert len(wav_a[1]) > 44 and wav_a[1] == wav_b[1] and pcm_a[1] == pcm_b[1]



class _Recorder:
    """A `_Sender` that keeps what the engine side would write."""

    def __init__(self) -> None:
        self.sent: list[m.Message] = []

    def send(self, msg: m.Message) -> None:
        self.sent.append(msg)


def test_backpressure_holds_a_request_at_the_window(plan: Path) -> None:
    """The engine side sends no more than WINDOW unacknowledged items of a request; an ack
    lets the rest through; a cancel while held back still ends the request with its finish."""
    import time

    from mstar_runtime.api import MStar
    from mstar_runtime.engine_process import WINDOW, _Relay

    with MStar.load(plan, weights="init") as mstar:
        rec = _Recorder()
        relay = _Relay(mstar.submit("slow", {"steps": 3 * WINDOW}), rec)  # type: ignore[arg-type]
        relay.thread.start()
        wait_for(lambda: len(rec.sent) >= WINDOW, 30, "the first window of items")
        wait_for(lambda: relay.handle.stats["steps"] >= WINDOW + 20, 30, "the engine to run past the window")
        time.sleep(0.1)
        assert len(rec.sent) == WINDOW  # held back, while the engine runs on
        relay.ack(WINDOW)  # lets one more window through
        wait_for(lambda: len(rec.sent) >= 2 * WINDOW, 30, "the second window of items")
        time.sleep(0.1)
        assert len(rec.sent) == 2 * WINDOW
        relay.ack(2 * WINDOW)
        relay.thread.join(30)
        assert [x.seq for x in rec.sent[:-1]] == list(range(3 * WINDOW))  # type: ignore[union-attr]
        assert isinstance(rec.sent[-1], m.EngineFinish) and rec.sent[-1].state == "finished"

        rec2 = _Recorder()
        held = _Relay(mstar.submit("slow", {"steps": LONG}), rec2)  # type: ignore[arg-type]
        held.thread.start()
        wait_for(lambda: len(rec2.sent) >= WINDOW, 30, "the second request's window")
        held.handle.cancel()
        held.stop()
        held.thread.join(30)
        assert not held.thread.is_alive()
        assert isinstance(rec2.sent[-1], m.EngineFinish) and rec2.sent[-1].reason == "cancelled"
        assert len(rec2.sent) == WINDOW + 1


def _relayed(mstar: object, walk: str, inputs: dict) -> tuple[list[m.Message], dict]:
    """What the engine side sends for one request (every message through the wire codec), and
    the request's outputs as the engine process's own handle gives them."""
    from mstar_runtime.engine_process import _Relay

    rec = _Recorder()
    relay = _Relay(mstar.submit(walk, inputs), rec)  # type: ignore[attr-defined, arg-type]
    relay.ack(1 << 62)  # no backpressure here
    relay.thread.start()
    relay.thread.join(60)
    assert not relay.thread.is_alive()
    return [m.decode(m.encode(x)) for x in rec.sent], relay.handle.result()


def test_finish_does_not_send_streamed_outputs_again(plan: Path) -> None:
    """An appended output crosses the process boundary once, as its `EngineOutput` items:
    `EngineFinish` names it in `streamed` with an empty placeholder, and the API side's rebuild
    (`finished_outputs`) gives exactly the engine's result, in its order."""
    from mstar_runtime.api import MStar
    from mstar_runtime.engine_process import finished_outputs

    with MStar.load(plan, weights="init") as mstar:
        sent, want = _relayed(mstar, "slow", {"steps": 40})
        finish, items = sent[-1], sent[:-1]
        assert isinstance(finish, m.EngineFinish) and finish.state == "finished"
        assert finish.streamed == ["xs"] and list(finish.outputs) == list(want)
        placeholder = finish.outputs["xs"]
        assert placeholder.tensor is None and placeholder.shm is None and placeholder.scalar is None
        streamed_bytes = sum(len(m.encode(x)) for x in items)
        assert want["xs"].numel() * 4 <= streamed_bytes  # the tensor went out as items ...
        assert len(m.encode(finish)) < 1024  # ... and not again at the end
        chunks = [(x.name, from_value(x.value)) for x in items]  # type: ignore[union-attr]
        got = finished_outputs(finish, chunks)
        assert list(got) == list(want) and torch.equal(got["xs"], want["xs"])

        # chat -> continue: `continue` emits `tokens` again, so the final `tokens` (continue's)
        # is not the concatenation of the streamed ones (chat's, then continue's): sent whole
        sent, want = _relayed(mstar, "chat", {"prompt": "hi", "max_new": 2})
        finish = sent[-1]
        assert isinstance(finish, m.EngineFinish) and finish.walks == ["chat", "continue"]
        streamed = [from_value(x.value) for x in sent[:-1] if x.name == "tokens"]  # type: ignore[union-attr]
        assert sum(t.numel() for t in streamed) > want["tokens"].numel()
        assert "tokens" not in finish.streamed and finish.outputs["tokens"].tensor is not None
        got = finished_outputs(finish, [(x.name, from_value(x.value)) for x in sent[:-1]])  # type: ignore[union-attr]
        assert list(got) == list(want) and all(torch.equal(torch.as_tensor(got[k]), torch.as_tensor(want[k]))
                                               for k in want)


def test_an_output_the_wire_cannot_carry_fails_its_request(plan: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value msgpack refuses (here a set, standing in for a node's bad output) once killed
    the relay thread, so the request never ended on the API side; now it ends failed."""
    import socket

    from mstar_runtime import engine_process as ep
    from mstar_runtime.api import MStar
    from mstar_runtime.worker.wire import read_frame

    with MStar.load(plan, weights="init") as mstar:
        ours, theirs = socket.socketpair()
        monkeypatch.setattr(ep, "to_value", lambda v: m.Value(scalar={1}))  # type: ignore[arg-type]
        sender = ep._Sender(ours)
        relay = ep._Relay(mstar.submit("slow", {"steps": 4}), sender)
        relay.ack(1 << 62)
        relay.thread.start()
        relay.thread.join(30)
        assert not relay.thread.is_alive()
        sender.out.close()  # the socket's file holds it open: both, for the reader's EOF
        ours.close()
        theirs.settimeout(30)
        inp, sent = theirs.makefile("rb"), []
        while (msg := read_frame(inp)) is not None:
            sent.append(msg)
        theirs.close()
    assert len(sent) == 1 and isinstance(sent[0], m.EngineFinish), sent
    assert sent[0].state == "failed" and "output 'xs' cannot be sent" in (sent[0].error or ""), sent[0]
