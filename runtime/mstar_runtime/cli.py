"""`mstar-run`: run a plan's walks from the command line.

    mstar-run PLAN --walk W [--input k=v ...] [--out DIR] [--weights DIR|dummy] [--device cpu|cuda] [--stream]
    mstar-run PLAN --requests FILE.jsonl --out DIR [--weights ...] [--device ...]
    mstar-run PLAN --serve [--host 127.0.0.1] [--port 8000] [--shutdown-timeout 30]

One-shot runs one request and writes its outputs as files (`outputs.write_outputs`: WAV,
PNG, text, JSON, safetensors, plus `<id>.json`). Batch reads one JSON object per line,
`{"id": optional, "walk": "...", "inputs": {...}}`, and runs them all concurrently through
one engine, so the conductor batches their steps; a malformed line or a bad request fails
that request only (reported with its line number, and an `<id>.json` record), never the
batch. A summary (throughput, steps, mean batch size, wasted speculative steps,
preemptions) ends the run and is saved as `summary.json`.

Exit codes: 0 when every request finished; 1 when any failed, or the plan or its weights
cannot load (one `mstar-run: error: ...` line, never a traceback for a user error);
2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from mstar_runtime.api import MStar, RequestFailed, RequestHandle
from mstar_runtime.control.validate import TORCH_DTYPES, validate_inputs
from mstar_runtime.ops.node import NodeError, RequestError
from mstar_runtime.outputs import jsonable, output_order, write_outputs
from mstar_runtime.plan.loader import Plan, PlanError, load_plan

PROG = "mstar-run"


class UserError(Exception):
    """A problem the user can fix (bad plan, bad input, unreadable file): one line, exit 1."""


# ----------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run the walks of a compiled M* plan: one request, a batch file, or a server.",
    )
    p.add_argument("plan", help="a plan file from `mstarc compile`")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--walk", help="run one request of this walk")
    mode.add_argument("--requests", metavar="FILE.jsonl",
                      help='run a batch: one {"id", "walk", "inputs"} JSON object per line')
    mode.add_argument("--serve", action="store_true",
                      help="serve the plan over HTTP: OpenAI-compatible and native routes (docs/serving.md)")
    p.add_argument("--input", "-i", action="append", default=[], metavar="K=V",
                   help="an input of the walk; parsed by its declared type (tensors: a JSON list or "
                        "@file.safetensors; images: @file.png|jpg). Repeatable")
    p.add_argument("--out", metavar="DIR", help="where output files go (one-shot default: ./out)")
    p.add_argument("--weights", default="dummy", metavar="DIR|dummy",
                   help="a folder of safetensors checkpoints, or 'dummy' for random weights (default)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="where to run (default: what the plan was compiled for)")
    p.add_argument("--stream", action="store_true", help="one-shot: print a line per streamed output chunk")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default: torch's). Tiny CPU models run fastest with 1")
    p.add_argument("--host", default="127.0.0.1", help="--serve: the address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="--serve: the port (default 8000)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="--serve: on SIGTERM, seconds in-flight requests get to finish before they are aborted "
                        "(default 30)")
    p.add_argument("--request-timeout", type=float, metavar="S",
                   help="--serve: fail a request that runs longer than this (finish reason 'timeout')")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="--serve: the model id clients name (default: the plan's model name)")
    p.add_argument("--step-path", choices=("cohort", "generic"), default=None,
                   help="how marked decode loops run: 'cohort' (device-resident batches, one step for every "
                        "request) or 'generic' (a step call per request); default $MSTAR_STEP_PATH, else cohort "
                        "(docs/runtime.md)")
    p.add_argument("--preempt-every", type=int, metavar="N", help=argparse.SUPPRESS)  # debug: force preemptions
    return p


# ----------------------------------------------------------------------------- inputs
def _bad(walk: str, name: str, message: str) -> RequestError:
    return RequestError(f"walk '{walk}', input '{name}': {message}", name)


def _read_image(walk: str, name: str, ref: str) -> torch.Tensor:
    from PIL import Image, UnidentifiedImageError

    path = Path(ref.removeprefix("@"))
    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")
    except FileNotFoundError:
        raise _bad(walk, name, f"image file '{path}' does not exist") from None
    except (UnidentifiedImageError, OSError) as e:
        raise _bad(walk, name, f"cannot read image '{path}': {e}") from None
    import numpy as np

    return torch.from_numpy(np.array(rgb, dtype=np.uint8))


def _read_safetensors(walk: str, name: str, ref: str) -> torch.Tensor:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(ref.removeprefix("@"))
    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise _bad(walk, name, f"tensor file '{path}' does not exist") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise _bad(walk, name, f"cannot read '{path}' as safetensors: {e}") from None
    if name in tensors:
        return tensors[name]
    if len(tensors) == 1:
        return next(iter(tensors.values()))
    raise _bad(walk, name, f"'{path}' holds {len(tensors)} tensors and none is named '{name}'")


def _parse_bool(walk: str, name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise _bad(walk, name, f"expected true or false, got '{text}'")


def parse_text(walk: str, name: str, t: Mapping[str, Any], text: str) -> Any:
    """A `--input` value parsed by the input's declared type (validation comes after)."""
    kind = t["kind"]
    if kind == "str":
        return text
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise _bad(walk, name, f"expected an integer, got '{text}'") from None
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise _bad(walk, name, f"expected a number, got '{text}'") from None
    if kind == "bool":
        return _parse_bool(walk, name, text)
    if kind == "image":
        return _read_image(walk, name, text)
    if text.startswith("@"):
        return _read_safetensors(walk, name, text)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise _bad(walk, name, f"expected a JSON list or @file.safetensors for a {t['dtype']} tensor, "
                               f"got '{text[:60]}'") from None
    try:
        return torch.tensor(data, dtype=TORCH_DTYPES[t["dtype"]])
    except (TypeError, ValueError, RuntimeError) as e:
        raise _bad(walk, name, f"not a {t['dtype']} tensor: {e}") from None


def parse_json_value(walk: str, name: str, t: Mapping[str, Any] | None, value: Any) -> Any:
    """A batch line's input: JSON values pass through (the walk's types check them); a string
    for an image or tensor input is a file reference, read as `--input` would."""
    if t is not None and t["kind"] in ("image", "tensor") and isinstance(value, str):
        return parse_text(walk, name, t, value)
    return value


def cli_inputs(plan: Plan, walk: str, pairs: Sequence[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """`--input k=v` pairs, parsed by the walk's declared input types and validated."""
    program = plan.walk(walk)
    declared = {p["name"]: p["type"] for p in program["inputs"]}
    raw: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            parser.error(f"--input expects NAME=VALUE, got '{pair}'")
        # an undeclared name stays a string: validate_inputs names it as unknown
        raw[name] = parse_text(walk, name, declared[name], text) if name in declared else text
    return validate_inputs(walk, program, raw)


# ----------------------------------------------------------------------------- one-shot
def _describe(value: Any) -> str:
    """One streamed chunk in a line: dtype and shape, and the values of a few integers (tokens)."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        shape = "x".join(str(s) for s in value.shape) or "scalar"
        if not value.is_floating_point() and value.numel() <= 8:
            return f"{dtype}[{shape}] {value.tolist()}"
        return f"{dtype}[{shape}]"
    return repr(value)[:80]


def run_one(m: MStar, args: argparse.Namespace, inputs: dict[str, Any]) -> int:
    out = Path(args.out or "out")
    program = m.plan.walk(args.walk)
    handle = m.submit(args.walk, inputs, request_id=args.walk)
    try:
        if args.stream:
            counts: dict[str, int] = {}
            for name, value in handle.stream():
                counts[name] = counts.get(name, 0) + 1
                print(f"stream {name} #{counts[name]}: {_describe(value)}", flush=True)
        outputs = handle.result()
    except RequestFailed as e:
        paths = write_outputs(out, handle.id, program, {}, m.plan.config, summary=handle.summary())
        print(f"{PROG}: error: request failed ({e.finish_reason}): {e.message}", file=sys.stderr)
        print(f"record -> {paths[-1]}")
        return 1
    paths = write_outputs(out, handle.id, program, outputs, m.plan.config, summary=handle.summary())
    for name, path in zip(output_order(program, outputs), paths):
        print(f"{name} -> {path}")
    print(f"record -> {paths[-1]}")
    return 0


# ----------------------------------------------------------------------------- batch
@dataclass
class BatchLine:
    """One request of a batch file, parsed or not."""

    line: int
    id: str
    walk: str | None = None
    inputs: dict[str, Any] | None = None
    error: RequestError | None = None


def parse_line(plan: Plan, line: int, text: str) -> BatchLine:
    """A batch line as a request; any problem becomes the line's `error`, never an exception."""
    fallback = f"line-{line}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLine(line, fallback, error=RequestError(f"malformed JSON: {e.msg} (column {e.colno})"))
    if not isinstance(obj, dict):
        return BatchLine(line, fallback, error=RequestError(f"expected a JSON object, got {type(obj).__name__}"))
    rid = obj.get("id", fallback)
    if isinstance(rid, bool) or not isinstance(rid, str | int) or rid == "":
        return BatchLine(line, fallback, error=RequestError("'id' must be a non-empty string or an integer", "id"))
    walk = obj.get("walk")
    item = BatchLine(line, str(rid), walk=walk if isinstance(walk, str) else None)
    unknown = sorted(set(obj) - {"id", "walk", "inputs"})
    raw = obj.get("inputs", {})
    try:
        if unknown:
            raise RequestError(f"unknown key(s) {', '.join(unknown)}; a line has id, walk and inputs", unknown[0])
        if not isinstance(item.walk, str):
            raise RequestError("'walk' (a string) is missing", "walk")
        if not isinstance(raw, dict):
            raise RequestError(f"'inputs' must be a JSON object, got {type(raw).__name__}", "inputs")
        declared = {p["name"]: p["type"] for p in plan.walk(item.walk)["inputs"]}
        item.inputs = {k: parse_json_value(item.walk, k, declared.get(k), v) for k, v in raw.items()}
    except RequestError as e:
        item.error = e
    return item


def read_lines(path: str) -> list[tuple[int, str]]:
    """(line number, text) of every non-blank line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"requests file '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read requests file '{path}': {e}") from None
    return [(n, t) for n, t in enumerate(text.splitlines(), 1) if t.strip()]


class BatchRun:
    """Submits a batch file's requests (at most `window` in flight), collects them as they
    end, writes their files, keeps the counts."""

    def __init__(self, m: MStar, out: Path, total: int):
        self.m, self.out = m, out
        self.done: queue.Queue[RequestHandle] = queue.Queue()  # filled by done callbacks (engine thread)
        self.line_of: dict[str, int] = {}
        self.in_flight = 0
        self.finished = 0
        self.failures: list[dict[str, Any]] = []
        # bounded so a huge file does not sit in memory as queued inputs; wide enough that
        # the conductor always has more waiting than it can run
        self.window = max(64, 4 * m.conductor.max_running)
        self.bar = tqdm(total=total, file=sys.stderr, unit="req", desc="requests", dynamic_ncols=True)

    def fail(self, line: int, rid: str, walk: str | None, message: str, field: str | None, reason: str,
             summary: dict[str, Any] | None = None, file_id: str | None = None) -> None:
        """Count a failed request, report it with its line number and write its `<id>.json`."""
        record = summary or {"id": rid, "walk": walk, "state": "failed", "error": message, "field": field,
                             "finish_reason": reason}
        record = {**record, "line": line}
        program = {"walk": walk, "outputs": []}
        write_outputs(self.out, file_id or rid, program, {}, self.m.plan.config, summary=record)
        self.failures.append({"line": line, "id": rid, "walk": walk, "error": message, "field": field,
                              "finish_reason": reason})
        self.bar.write(f"{PROG}: line {line} (id '{rid}'): {message}", file=sys.stderr)
        self.bar.update(1)
        self.bar.set_postfix(failed=len(self.failures))

    def submit(self, item: BatchLine, seen: dict[str, int]) -> None:
        while self.in_flight >= self.window:
            self.collect(block=True)
        file_id = item.id
        if item.error is None and item.id in seen:
            item.error = RequestError(f"duplicate id '{item.id}' (first on line {seen[item.id]})", "id")
            file_id = f"line-{item.line}"  # its record must not overwrite the first one's
        seen.setdefault(item.id, item.line)
        if item.error is None:
            try:
                handle = self.m.submit(item.walk or "", item.inputs, request_id=item.id)
            except RequestError as e:
                item.error = e
            else:
                self.line_of[handle.id] = item.line
                self.in_flight += 1
                handle.add_done_callback(self.done.put)
        if item.error is not None:
            self.fail(item.line, item.id, item.walk, str(item.error), item.error.field, "invalid", file_id=file_id)
        while self.collect(block=False):
            pass

    def collect(self, block: bool) -> bool:
        try:
            handle = self.done.get(block=block)
        except queue.Empty:
            return False
        self.in_flight -= 1
        line = self.line_of.pop(handle.id)
        summary = {**handle.summary(), "line": line}
        try:
            outputs = handle.result()
        except RequestFailed as e:
            self.fail(line, handle.id, handle.walk, e.message, e.field, e.finish_reason, summary)
            return True
        write_outputs(self.out, handle.id, self.m.plan.walk(handle.walk), outputs, self.m.plan.config,
                      summary=summary)
        self.finished += 1
        self.bar.update(1)
        return True


def run_batch(m: MStar, args: argparse.Namespace) -> int:
    out = Path(args.out)
    lines = read_lines(args.requests)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    run = BatchRun(m, out, len(lines))
    seen: dict[str, int] = {}
    try:
        for number, text in lines:
            run.submit(parse_line(m.plan, number, text), seen)
        while run.in_flight:
            run.collect(block=True)
    finally:
        run.bar.close()
    wall = time.perf_counter() - t0
    st = m.stats()
    summary = {
        "requests": len(lines),
        "finished": run.finished,
        "failed": len(run.failures),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(lines) / wall, 2) if wall > 0 else 0.0,
        "steps": int(st["steps"]),
        "mean_batch": round(st["mean_batch"], 2),
        "wasted_steps": int(st["wasted_steps"]),
        "preemptions": int(st["preemptions"]),
        "cohort_steps": int(st.get("cohort_steps", 0)),  # decode cohort steps (0 on the generic path)
        "failures": sorted(run.failures, key=lambda f: f["line"]),
    }
    (out / "summary.json").write_text(json.dumps(jsonable(summary), indent=2) + "\n", encoding="utf-8")
    print(f"requests: {summary['requests']}  finished: {summary['finished']}  failed: {summary['failed']}")
    print(f"wall time: {wall:.2f} s  throughput: {summary['requests_per_s']} requests/s")
    print(f"steps: {summary['steps']}  mean batch size: {summary['mean_batch']}  "
          f"wasted speculative steps: {summary['wasted_steps']}  preemptions: {summary['preemptions']}")
    print(f"summary -> {out / 'summary.json'}")
    return 1 if run.failures else 0


# ----------------------------------------------------------------------------- main
def _check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.requests and not args.out:
        parser.error("--requests needs --out DIR")
    if args.input and not args.walk:
        parser.error("--input goes with --walk (a batch file carries its own inputs)")
    if args.stream and not args.walk:
        parser.error("--stream goes with --walk")
    if not args.serve and (args.shutdown_timeout != 30.0 or args.request_timeout is not None
                           or args.served_model_name is not None):
        parser.error("--shutdown-timeout, --request-timeout and --served-model-name go with --serve")
    if args.serve and not 0 <= args.port < 65536:
        parser.error("--port must be in 0..65535 (0: any free port)")
    if args.shutdown_timeout < 0 or (args.request_timeout is not None and args.request_timeout <= 0):
        parser.error("--shutdown-timeout must be >= 0 and --request-timeout > 0")
    for flag in ("threads", "preempt_every"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_usage(parser, args)
    if args.serve:
        return _serve(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        plan = load_plan(args.plan, device=args.device)
        inputs = cli_inputs(plan, args.walk, args.input, parser) if args.walk else {}
        m = MStar.from_plan(plan, weights=args.weights, preempt_every=args.preempt_every, step_path=args.step_path)
    except _startup_errors() as e:
        return _error(e)
    except KeyboardInterrupt:
        return 130
    with m:
        try:
            return run_one(m, args, inputs) if args.walk else run_batch(m, args)
        except UserError as e:
            return _error(e)
        except OSError as e:  # the output folder: missing permissions, a full disk
            return _error(f"cannot write {e.filename or 'the output files'}: {e.strerror or e}")
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted", file=sys.stderr)
            return 130


def _serve(args: argparse.Namespace) -> int:
    """`--serve`: load the plan and serve it until SIGTERM (mstar_runtime.serve.server)."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from mstar_runtime.serve.server import run_cli

    try:
        return run_cli(args)
    except _startup_errors() as e:
        return _error(e)
    except KeyboardInterrupt:
        return 130


def _startup_errors() -> tuple[type[BaseException], ...]:
    """What loading can fail with for reasons the user can fix: a bad plan, weights or input,
    and a worker process that did not start (when the multi-rank runtime is installed)."""
    errors: tuple[type[BaseException], ...] = (PlanError, NodeError, RequestError)
    try:
        from mstar_runtime.worker.remote import WorkerLost
    except ImportError:
        return errors
    return (*errors, WorkerLost)


def _error(e: BaseException | str) -> int:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
