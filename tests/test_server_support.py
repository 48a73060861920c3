"""Shared by the server tests (no tests here): plans, a server in a subprocess, bounded waits.

The plan is the test family (tiny) plus four walks this file appends to its model, so every
route has a walk (each declares the route it serves) and lifecycle tests have a request that
runs as long as they need:
`tts` (text -> streamed audio through the sliding-window codec), `t2i` and `edit` (a flow
latent as an image; `edit` takes an image input), and `slow` (holds a KV context and
streams one latent per flow step, `steps` steps: about 1 ms each on CPU). `tts_long` is a
second `tts` walk (so it replaces `tts`, never beside it) that streams one 32-sample audio
chunk per flow step for `steps` steps: a speech stream that runs as long as a test needs.
`renamed` passes its input `budget` to the port `max_new`, so a node's refusal of the port
must be reported as the input.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a shared 2-core box: multi-threaded torch is 30-100x slower under load
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
START_TIMEOUT_S = 90.0
MODEL = "testfamily"

EXTRA_WALKS: dict[str, str] = {
    "tts": """
  walk tts(text: str, voice: str = "tara", max_new: int = 16) -> (audio: f32[S]) serves speech(input = text) {
    ids = prompt.encode(text = text)
    token, code, done, h = lm.prefill(tokens = ids, max_new = max_new) @main
    dynamic_loop max = max_new_tokens until done carry token, done {
      token, c, done, hid = lm.decode(token = token) @main
    }
    on stream lm.code -> codec.window as w {
      pcm = codec.decode_window(window = w)
      emit audio += pcm
    }
  }
""",
    "t2i": """
  walk t2i(prompt: str, seed: int = 0, steps: int = 4) -> (image: f32[latent_len, latent_dim])
      serves image_generations {
    ids = prompt.encode(text = prompt)
    x = flow.init(seed = seed)
    lm.prefill(tokens = ids, max_new = 1) @main
    loop n = steps max = max_flow_steps index i carry x {
      t, dt = flow.time(index = i, steps = steps)
      v = lm.denoise(x = x, t = t) @main
      x = flow.step(x = x, v_cond = v, v_uncond = v, dt = dt, scale = 1.0)
    }
    emit image = x
  }
""",
    "edit": """
  walk edit(prompt: str, image: image, seed: int = 0) -> (image: f32[latent_len, latent_dim])
      serves image_edits(output = image) {
    ids = prompt.encode(text = prompt)
    x = flow.init(seed = seed)
    lm.prefill(tokens = ids, max_new = 1) @main
    emit image = x
  }
""",
    "slow": """
  walk slow(prompt: str = "x", steps: int = 100, seed: int = 0) -> (xs: f32[N, latent_dim]) {
    ids = prompt.encode(text = prompt)
    lm.prefill(tokens = ids, max_new = 1) @main
    x = flow.init(seed = seed)
    loop n = steps max = 1000000 index i carry x {
      t, dt = flow.time(index = i, steps = steps)
      v = lm.denoise(x = x, t = t) @main
      x = flow.step(x = x, v_cond = v, v_uncond = v, dt = dt, scale = 1.0)
      emit xs += x
    }
  }
""",
    "renamed": """
  walk renamed(prompt: str, budget: int = 4) -> (tokens: i32[N]) {
    ids = prompt.encode(text = prompt)
    token, code, done, h = lm.prefill(tokens = ids, max_new = budget) @main
    emit tokens += token
  }
""",
    "tts_long": """
  walk tts(text: str, steps: int = 100) -> (audio: f32[N, latent_dim]) serves speech(input = text) {
    ids = prompt.encode(text = text)
    lm.prefill(tokens = ids, max_new = 1) @main
    x = flow.init(seed = 0)
    loop n = steps max = 1000000 index i carry x {
      t, dt = flow.time(index = i, steps = steps)
      v = lm.denoise(x = x, t = t) @main
      x = flow.step(x = x, v_cond = v, v_uncond = v, dt = dt, scale = 1.0)
      emit audio += x
    }
  }
""",
}
DEFAULT_EXTRA = ("tts", "t2i", "edit", "slow")


def compile_plan(out_dir: Path, placement: str = "placements/cpu.yaml",
                 extra: tuple[str, ...] = DEFAULT_EXTRA) -> Path:
    """The test family (tiny) with the `extra` walks of EXTRA_WALKS appended, compiled for `placement`."""
    from mstarc.cli import main as mstarc

    src = (ROOT / "models/testfamily/testfamily.walk").read_text(encoding="utf-8").rstrip()
    assert src.endswith("}")
    walk = out_dir / f"tfx-{'-'.join(extra) or 'plain'}.walk"
    walk.write_text(src[:-1] + "".join(EXTRA_WALKS[w] for w in extra) + "}\n", encoding="utf-8")
    plan = walk.with_name(f"{walk.stem}-{Path(placement).stem}.plan")
    assert mstarc(["compile", str(walk), "--variant", "tiny", "-p", str(ROOT / placement), "-o", str(plan)]) == 0
    return plan


def get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback test server
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post(url: str, body: object, timeout: float = 30.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of metric `name` in a Prometheus text exposition: (labels, value)."""
    out = []
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        series, _, rest = head.partition("{")
        if series != name:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
        out.append((labels, float(value)))
    return out


def metric(base: str, name: str, labels: str = "") -> float:
    """One sample of /metrics: the sum over the series of `name` whose labels include `labels`
    (`'walk="chat",outcome="finished"'`, in any order; every series carries `model_name` too);
    0 when none exists yet."""
    _, text = get(base + "/metrics")
    want = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    return sum(v for got, v in samples(text.decode(), name) if want.items() <= got.items())


def send_request(base: str, path: str, body: object) -> socket.socket:
    """Send a POST on a raw socket; the socket, before any of the response has arrived."""
    host, port = base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def open_stream(base: str, path: str, body: object) -> socket.socket:
    """Send a request on a raw socket and return it once the response has started (a 200)."""
    s = send_request(base, path, body)
    assert s.recv(12).startswith(b"HTTP/1.1 200")
    return s


def read_all(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        out += chunk
        if out.endswith(b"0\r\n\r\n"):  # the last chunk of a chunked body
            break
    return out


def ndjson_lines(raw: bytes) -> list[dict]:
    """JSON objects of a chunked NDJSON body (the chunk-size lines are not JSON objects)."""
    out = []
    for line in raw.decode(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            out.append(json.loads(line))
    return out


class Reader:
    """Reads a response on a raw socket to its end on a thread, so that a test can hold
    several streams open without any of them stalling the server on a full socket."""

    def __init__(self, s: socket.socket, timeout: float = 120.0):
        self.sock = s
        self.data = b""
        self.ended = threading.Event()
        s.settimeout(timeout)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    break
                self.data += chunk
                if self.data.endswith(b"0\r\n\r\n"):  # the last chunk of a chunked NDJSON body
                    break
        except OSError:
            pass
        finally:
            self.ended.set()

    def result(self, timeout: float) -> bytes:
        assert self.ended.wait(timeout), f"the response did not end within {timeout} s"
        return self.data

    def hang_up(self) -> None:
        """Close the connection as a client that leaves does."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.ended.wait(30)
        self.sock.close()


def wait_for(pred, timeout: float, what: str, every: float = 0.05) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Server:
    """`mstar-run PLAN --serve --port 0` in a subprocess on 127.0.0.1 (it picks a free port and
    says which on its first line, so two test runs never race for one)."""

    def __init__(self, plan: Path, *args: str, env: dict[str, str] | None = None):
        self.log = plan.parent / f"server-{time.monotonic_ns()}.log"
        self._log = self.log.open("wb")
        cmd = [sys.executable, "-m", "mstar_runtime.cli", str(plan), "--serve", "--port", "0",
               "--weights", "init", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**ENV, **(env or {})},
                                     cwd=ROOT)
        self.base = ""
        try:
            wait_for(self._up, START_TIMEOUT_S, f"the server to start ({self.log})", every=0.2)
        except BaseException:
            self.stop()
            raise

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
        if not self.base:
            found = re.search(r" on (http://127\.0\.0\.1:\d+)", self.output())
            if found is None:
                return False
            self.base = found.group(1)
        try:
            return get(self.base + "/health", timeout=2)[0] == 200
        except OSError:
            return False

    def output(self) -> str:
        self._log.flush()
        return self.log.read_text(errors="replace")

    def children(self) -> list[int]:
        """Pids of the server's child processes (worker ranks)."""
        kids = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = (d / "stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                        kids.append(int(d.name))
        return kids

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit status (bounded wait)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def serving(plan: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """`Server(plan, *args)` (`env`: variables added to the server's environment), stopped at the end."""
    server = Server(plan, *args, env=env)
    try:
        yield server
    finally:
        server.stop()
