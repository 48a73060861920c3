"""TTFA of live voice sessions over `/v1/realtime` (the OpenAI Realtime event protocol): from
the moment the client sends `input_audio_buffer.commit` to the first `response.audio.delta`
it receives, at 1, 16, ... concurrent sessions.

    python tools/bench/realtime.py --plan /tmp/q-tiny.plan --sessions 1,4 --turns 2 --seconds 0.5 \
        --extra '{"talker_max_frames": 8, "max_output_tokens": 8}'          # CPU: starts the server itself
    python tools/bench/realtime.py --url ws://127.0.0.1:8000/v1/realtime --sessions 1,16 --turns 3 \
        --seconds 2.0 --extra '{"talker_max_frames": 128}' --out $OUT/realtime.json   # a server already up

Each session connects, sends `session.update` (`--voice`, `--instructions`, modalities text and
audio), then `--turns` turns: the user's audio (`--seconds` of a synthetic voiced tone at
24 kHz pcm16, a different pitch each turn) as `input_audio_buffer.append` events of
`--chunk-ms` each, sent as fast as the socket takes them (`--pace` sends them in real time,
as a microphone would, and the clock still starts at the commit), then the commit and at
once `response.create` (with `--extra` merged into its `response`: walk inputs such as
`talker_max_frames`, `seed`), then it reads to `response.done`. The conversation grows turn
by turn, so turn 2 onwards carries the history (and what a prefix cache saves shows in
their figures, which are reported apart from turn 1's). A run holds `--sessions N`
sessions at once; `--warmup` turns of one session go first, untimed.

Figures per run (p50 / p90 / p99 / mean / min / max, seconds; linear-interpolation
percentiles): `ttfa` from the commit to the first `response.audio.delta`, `ttft` to the
first non-empty `response.audio_transcript.delta` (or `response.text.delta`), `turn` to
`response.done`; `ttfa_first_turn` and `ttfa_later_turns` split TTFA by turn; the audio
received (seconds of 16-bit samples at `--sample-rate`) per second of the run;
`empty_transcripts`, the ok turns whose `response.audio_transcript.done` (or
`response.text.done`) text is empty: they have no TTFT, so its n is the ok turns less these.
A model whose ids decode to nothing gives such turns: Qwen3-Omni at real size with `--weights
dummy` has no checkpoint tokenizer, and the bundled 512-id one decodes 479 of its 152,064 ids
(random weights' tokens land elsewhere: the reply is empty, TTFT n = 0). A turn is
`ok` when its `response.done` says `completed` or `incomplete` and no `error` event came;
the others count under `errors` by code. Exit status 1 when any turn failed, 2 for bad usage.

The script imports nothing of the runtime (`websockets`, asyncio), so it measures any server
that speaks the protocol (`--plan` starts `mstar-run PLAN --serve` of this checkout). GPU run
(issue 28), not run in this session: one H200, Qwen3-Omni at real size with dummy weights,

    python -m mstarc.cli compile models/qwen3_omni/qwen3_omni.walk --variant real -p placements/h200x1.yaml \
        -o /tmp/q.plan
    python tools/bench/realtime.py --plan /tmp/q.plan --weights dummy --device cuda --sessions 1,16 --turns 3 \
        --seconds 2.0 --extra '{"talker_max_frames": 128, "max_output_tokens": 32}' --out $OUT/realtime.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CLIENT_RATE = 24000


@dataclass
class Turn:
    session: int
    index: int
    ok: bool = False
    ttfa: float | None = None
    ttft: float | None = None
    turn: float | None = None
    audio_bytes: int = 0
    text_chars: int = 0  # of the reply's text, as its `.done` event gives it
    errors: list[str] = field(default_factory=list)


def voiced(seconds: float, pitch: float) -> bytes:
    """A voiced synthetic tone (a fundamental and four harmonics, a 4 Hz tremolo), pcm16 at 24 kHz."""
    n = int(seconds * CLIENT_RATE)
    out = bytearray()
    for i in range(n):
        t = i / CLIENT_RATE
        x = sum(math.sin(2 * math.pi * pitch * k * t) / k for k in range(1, 6)) * 0.15
        x *= 0.6 + 0.4 * math.sin(2 * math.pi * 4 * t)
        out += int(max(-1.0, min(1.0, x)) * 32767).to_bytes(2, "little", signed=True)
    return bytes(out)


def percentile(values: Sequence[float], q: float) -> float | None:
    vals = sorted(values)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def stats(values: Sequence[float | None]) -> dict[str, float | int | None]:
    vals = [v for v in values if v is not None]
    return {"n": len(vals), "mean": sum(vals) / len(vals) if vals else None, "p50": percentile(vals, 50),
            "p90": percentile(vals, 90), "p99": percentile(vals, 99), "min": min(vals, default=None),
            "max": max(vals, default=None)}


async def session(args: argparse.Namespace, who: int, turns: int, audio: list[bytes],
                  extra: dict[str, Any]) -> list[Turn]:
    import websockets

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    out: list[Turn] = []
    async with websockets.connect(args.url, additional_headers=headers, max_size=None,
                                  open_timeout=args.timeout) as ws:

        async def recv() -> dict[str, Any]:
            return json.loads(await asyncio.wait_for(ws.recv(), args.timeout))

        created = await recv()
        if created.get("type") != "session.created":
            raise RuntimeError(f"the server's first event is {created.get('type')!r}, not session.created")
        update: dict[str, Any] = {"modalities": ["text", "audio"]}
        if args.voice:
            update["voice"] = args.voice
        if args.instructions:
            update["instructions"] = args.instructions
        await ws.send(json.dumps({"type": "session.update", "session": update}))
        got = await recv()
        if got.get("type") != "session.updated":
            raise RuntimeError(f"session.update was answered with {json.dumps(got)[:300]}")
        step = max(2, int(CLIENT_RATE * args.chunk_ms / 1000) * 2)
        for index in range(turns):
            t = Turn(who, index)
            data = audio[index % len(audio)]
            for at in range(0, len(data), step):
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(data[at:at + step]).decode()}))
                if args.pace:
                    await asyncio.sleep(args.chunk_ms / 1000)
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create", "response": extra}))
            while True:
                event = await recv()
                kind = event.get("type")
                now = time.perf_counter() - t0
                if kind == "response.audio.delta":
                    t.ttfa = now if t.ttfa is None else t.ttfa
                    t.audio_bytes += len(base64.b64decode(event.get("delta", "")))
                elif kind in ("response.audio_transcript.delta", "response.text.delta"):
                    if event.get("delta"):  # an empty piece is no text yet
                        t.ttft = now if t.ttft is None else t.ttft
                elif kind in ("response.audio_transcript.done", "response.text.done"):
                    t.text_chars = len(event.get("transcript" if kind.endswith("transcript.done") else "text") or "")
                elif kind == "error":
                    t.errors.append(str(event.get("error", {}).get("code")))
                elif kind == "response.done":
                    t.turn = now
                    status = event.get("response", {}).get("status")
                    if status not in ("completed", "incomplete"):
                        t.errors.append(f"status {status}")
                    break
            t.ok = not t.errors
            out.append(t)
    return out


async def run(args: argparse.Namespace, sessions: int, audio: list[bytes], extra: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(session(args, i, args.turns, audio, extra) for i in range(sessions)),
                                   return_exceptions=True)
    wall = time.perf_counter() - t0
    turns: list[Turn] = []
    errors: dict[str, int] = {}
    for r in results:
        if isinstance(r, BaseException):
            key = f"{type(r).__name__}: {str(r)[:120]}"
            errors[key] = errors.get(key, 0) + 1
            continue
        turns.extend(r)
    for t in turns:
        for e in t.errors:
            errors[e] = errors.get(e, 0) + 1
    ok = [t for t in turns if t.ok]
    audio_s = sum(t.audio_bytes for t in ok) / 2 / args.sample_rate
    return {"sessions": sessions, "turns": len(turns), "ok": len(ok), "failed": len(turns) - len(ok) + sum(
        1 for r in results if isinstance(r, BaseException)), "errors": errors, "wall_s": wall,
        "ttfa": stats([t.ttfa for t in ok]), "ttft": stats([t.ttft for t in ok]), "turn": stats([t.turn for t in ok]),
        "ttfa_first_turn": stats([t.ttfa for t in ok if t.index == 0]),
        "ttfa_later_turns": stats([t.ttfa for t in ok if t.index > 0]),
        "empty_transcripts": sum(1 for t in ok if not t.text_chars),
        "audio_s_per_s": audio_s / wall if wall > 0 else None}


@contextmanager
def own_server(args: argparse.Namespace) -> Iterator[str]:
    """`mstar-run PLAN --serve --port 0` in a subprocess: its /v1/realtime URL, until the end."""
    cmd = [sys.executable, "-m", "mstar_runtime.cli", str(args.plan), "--serve", "--port", "0", "--no-access-log",
           "--weights", args.weights, "--device", args.device]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, cwd=ROOT, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            found = re.search(r"mstar-run: serving .* on http://([\d.]+:\d+)", line)
            if found:
                break
            if line.startswith("mstar-run: error"):
                raise RuntimeError(line.strip())
        else:
            raise RuntimeError(f"the server exited with {proc.wait()} before serving")
        # keep reading its log, so that a full pipe never stalls it
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
        yield f"ws://{found.group(1)}/v1/realtime"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def report(runs: Sequence[dict[str, Any]]) -> str:
    head = f"{'sessions':>8} {'turns':>5} {'ok':>4} {'TTFA p50':>9} {'p90':>7} {'p99':>7} {'turn 1':>7} " \
           f"{'later':>7} {'TTFT p50':>9} {'turn p50':>9} {'audio s/s':>9}"
    rows = [head, "-" * len(head)]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1000 * v:.0f}ms"

    for r in runs:
        rows.append(f"{r['sessions']:>8} {r['turns']:>5} {r['ok']:>4} {ms(r['ttfa']['p50']):>9} "
                    f"{ms(r['ttfa']['p90']):>7} {ms(r['ttfa']['p99']):>7} {ms(r['ttfa_first_turn']['p50']):>7} "
                    f"{ms(r['ttfa_later_turns']['p50']):>7} {ms(r['ttft']['p50']):>9} {ms(r['turn']['p50']):>9} "
                    f"{(r['audio_s_per_s'] or 0):>9.2f}")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="the server's realtime URL, ws://HOST:PORT/v1/realtime")
    where.add_argument("--plan", type=Path, help="start `mstar-run PLAN --serve` here and measure it")
    ap.add_argument("--weights", default="init", help="with --plan: the server's --weights (default init)")
    ap.add_argument("--device", default="cpu", help="with --plan: the server's --device (default cpu)")
    ap.add_argument("--sessions", default="1,16", help="concurrent sessions per run, a comma list (default 1,16)")
    ap.add_argument("--turns", type=int, default=3, help="turns per session (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed turns of one session first (default 1)")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds of user audio per turn (default 2)")
    ap.add_argument("--chunk-ms", type=float, default=100.0, help="audio per append event (default 100 ms)")
    ap.add_argument("--pace", action="store_true", help="send the audio in real time, as a microphone does")
    ap.add_argument("--voice", default=None, help="session.voice (default: the server's)")
    ap.add_argument("--instructions", default="You are a helpful voice assistant. Answer briefly.")
    ap.add_argument("--extra", default="{}", help="JSON merged into every response.create's response")
    ap.add_argument("--sample-rate", type=int, default=24000, help="the rate of the audio deltas (default 24000)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any one event")
    ap.add_argument("--out", default=None, help="JSON output (default $OUT/realtime.json when $OUT is set)")
    args = ap.parse_args(argv)
    try:
        args.session_counts = [int(x) for x in args.sessions.split(",") if x.strip()]
        args.extra_body = json.loads(args.extra)
    except ValueError as e:
        ap.error(f"--sessions is a comma list of integers and --extra a JSON object: {e}")
    if not isinstance(args.extra_body, dict) or not args.session_counts or min(args.session_counts) < 1:
        ap.error("--extra must be a JSON object and every --sessions value at least 1")
    if args.turns < 1 or args.seconds <= 0.1:
        ap.error("--turns must be at least 1 and --seconds over 0.1 (a commit needs 100 ms)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    audio = [voiced(args.seconds, pitch) for pitch in (140.0, 190.0, 120.0, 230.0)]
    out = args.out or (str(Path(os.environ["OUT"]) / "realtime.json") if os.environ.get("OUT") else None)
    rec: dict[str, Any] = {"command": sys.argv if argv is None else ["realtime.py", *argv],
                           "settings": {k: v for k, v in vars(args).items() if k not in ("api_key", "plan")},
                           "runs": []}

    def measure(url: str) -> None:
        args.url = url
        if args.warmup:
            warm = argparse.Namespace(**{**vars(args), "turns": args.warmup})
            asyncio.run(session(warm, -1, args.warmup, audio, args.extra_body))
        for n in args.session_counts:
            rec["runs"].append(asyncio.run(run(args, n, audio, args.extra_body)))
            print(report(rec["runs"][-1:]) if len(rec["runs"]) == 1 else report(rec["runs"]).splitlines()[-1],
                  flush=True)
            if out:
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                Path(out).write_text(json.dumps(rec, indent=2) + "\n")

    if args.plan is not None:
        with own_server(args) as url:
            measure(url)
    else:
        measure(args.url)
    print("\n" + report(rec["runs"]))
    empty = sum(r["empty_transcripts"] for r in rec["runs"])
    if empty:
        print(f"{empty} of {sum(r['ok'] for r in rec['runs'])} ok turns had an empty transcript (no TTFT)")
    return 1 if any(r["failed"] for r in rec["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
