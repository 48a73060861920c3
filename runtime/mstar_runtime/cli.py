"""`mstar-run`: run a plan's walks from the command line (click).

    mstar-run PLAN --walk W [--input k=v ...] [--out DIR] [--weights DIR|dummy] [--device cpu|cuda] [--stream]
    mstar-run PLAN --requests FILE.jsonl --out DIR [--weights ...] [--device ...]
    mstar-run PLAN --serve [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--no-access-log] [...]

One-shot runs one request and writes its outputs as files (`outputs.write_outputs`: WAV,
PNG, text, JSON, safetensors, plus `<id>.json`). Batch reads one JSON object per line,
`{"id": optional, "walk": "...", "inputs": {...}}`, and runs them all concurrently through
one engine, so the conductor batches their steps; a malformed line or a bad request fails
that request only (reported with its line number, and an `<id>.json` record), never the
batch. The file is read a line at a time (`request_lines`; a line over 64 MiB fails alone),
so a batch of any length takes the memory of the requests in flight only. A summary (throughput, steps, mean batch size, wasted speculative steps,
preemptions) ends the run and is saved as `summary.json`. Serve: docs/serving.md.

Each mode is a plain function too, for callers without a command line (a launcher):
`run_walk`, `run_requests` and `run_server` load a plan and return the exit status;
`one_shot` and `batch` run on an `MStar` already loaded (as `serve.server.serve` does).

Options whose help names an environment variable (`MSTAR_PORT`, `MSTAR_API_KEY`, ...) read
it when the option is not given. Exit codes: 0 when every request finished; 1 when any
failed, or the plan or its weights cannot load (one `mstar-run: error: ...` line, never a
traceback for a user error); 2 for bad usage; 3 for an internal error (`cli_support`).
"""

from __future__ import annotations

import json
import os
import queue
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import click
import torch
from tqdm import tqdm

from mstar_runtime import untrusted
from mstar_runtime.api import MStar, RequestFailed, RequestHandle
from mstar_runtime.cli_inputs import cli_inputs, no_rate, parse_json_value, split_pairs
from mstar_runtime.cli_support import CONTEXT_SETTINGS, run_command, version_option
from mstar_runtime.control.scheduler import (
    DEFAULT_PREFIX_CHUNK,
    MAX_WAIT,
    PrefixChunkError,
    check_prefix_chunk,
)
from mstar_runtime.engine_options import EngineOptions, start_engine
from mstar_runtime.ops.node import NodeError, RequestError
from mstar_runtime.outputs import jsonable, output_order, write_outputs
from mstar_runtime.plan.loader import Plan, PlanError, load_plan

if TYPE_CHECKING:
    from mstar_runtime.serve.server import ServeConfig

PROG = "mstar-run"


class UserError(Exception):
    """A problem the user can fix (bad plan, bad input, unreadable file): one line, exit 1."""


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


def one_shot(m: MStar, walk: str, inputs: Mapping[str, Any], out: str | PathLike[str] = "out",
             stream: bool = False) -> int:
    """Run one request of `walk` (inputs already parsed and validated) and write its files to
    `out`; with `stream`, a line per streamed chunk first. Exit status: 0, or 1 if it failed."""
    out = Path(out)
    program = m.plan.walk(walk)
    handle = m.submit(walk, dict(inputs), request_id=walk)
    try:
        if stream:
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


def parse_line(plan: Plan, line: int, text: str, rates: Callable[[str, str], int] | None = None) -> BatchLine:
    """A batch line as a request; any problem becomes the line's `error`, never an exception.
    `rates(walk, input)`: the rate a WAV file is resampled to (`MStar.input_rate`)."""
    fallback = f"line-{line}"
    try:
        obj = untrusted.loads_json(text)
    except json.JSONDecodeError as e:
        return BatchLine(line, fallback, error=RequestError(f"malformed JSON: {e.msg} (column {e.colno})"))
    except (untrusted.JSONTooDeep, untrusted.JSONConstant) as e:
        return BatchLine(line, fallback, error=RequestError(f"malformed JSON: {e}"))
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
        walk_name = item.walk

        def rate_of(name: str) -> Callable[[], int]:
            return (lambda: rates(walk_name, name)) if rates is not None else no_rate

        item.inputs = {k: parse_json_value(walk_name, k, declared.get(k), v, rate_of(k)) for k, v in raw.items()}
    except RequestError as e:
        item.error = e
    return item


MAX_BATCH_LINE_BYTES = 64 << 20  # one request a line, bounded like a request body of the server


def open_requests(path: str) -> BinaryIO:
    """The batch file, opened for reading: a regular file or a pipe (`--requests /dev/stdin`),
    not a directory or a device, which has no lines to end. Raises `UserError`."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - returned open; the caller closes it
    except FileNotFoundError:
        raise UserError(f"requests file '{path}' does not exist") from None
    except OSError as e:
        raise UserError(f"cannot read requests file '{path}': {e.strerror or e}") from None
    mode = os.fstat(f.fileno()).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or f.isatty()):
        f.close()
        raise UserError(f"cannot read requests file '{path}': not a regular file or a pipe")
    return f


def request_lines(f: BinaryIO, max_bytes: int = MAX_BATCH_LINE_BYTES) -> Iterator[tuple[int, str | RequestError]]:
    """(line number, text) of every non-blank line of `f`, read one line at a time, so a batch
    of any length holds one line in memory. A line over `max_bytes` bytes (its "\n" or "\r\n"
    not counted) is read past in pieces of that size and comes as a `RequestError` instead of
    its text, as does a line that is not UTF-8. Lines end at a newline only (a U+2028 in a
    JSON string is text)."""
    number = 0
    while True:
        chunk = f.readline(max_bytes + 2)  # the line and its "\r\n"
        if not chunk:
            return
        number += 1
        ended = chunk.endswith(b"\n")
        body = chunk[:-1] if ended else chunk
        if ended and body.endswith(b"\r"):
            body = body[:-1]
        if len(body) > max_bytes:
            while not ended:  # the rest of the line, read past in pieces of the same bound
                part = f.readline(max_bytes + 2)
                ended = not part or part.endswith(b"\n")
            yield number, RequestError(f"the line is longer than {max_bytes} bytes, the limit for one request")
            continue
        if not body.strip():
            continue
        try:
            yield number, body.decode("utf-8")
        except UnicodeDecodeError as e:
            yield number, RequestError(f"the line is not UTF-8 (byte {e.start + 1})")


def count_requests(f: BinaryIO, max_bytes: int = MAX_BATCH_LINE_BYTES) -> int | None:
    """How many requests (non-blank lines) a batch file holds, for the progress bar, read line by
    line and rewound; None for a pipe, which can be read only once."""
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        return None
    n = sum(1 for _ in request_lines(f, max_bytes))
    f.seek(0)
    return n


SUMMARY = "summary"  # the batch's own record, `summary.json`
RESERVED = (SUMMARY,)  # a request with that id gets a hashed file stem, not the batch's file


class BatchRun:
    """Submits a batch file's requests (at most `window` in flight), collects them as they
    end, writes their files, keeps the counts."""

    def __init__(self, m: MStar, out: Path, total: int | None):
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
        write_outputs(self.out, file_id or rid, program, {}, self.m.plan.config, summary=record, reserved=RESERVED)
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
                      summary=summary, reserved=RESERVED)
        self.finished += 1
        self.bar.update(1)
        return True


def batch(m: MStar, requests: str | PathLike[str], out: str | PathLike[str]) -> int:
    """Run every request of the JSONL file `requests` concurrently, writing their files and
    `summary.json` to `out`. The file is read a line at a time as requests are submitted (at
    most `BatchRun.window` in flight), each line at most `MAX_BATCH_LINE_BYTES`. Exit status: 0
    when all finished, 1 when any failed (a line too long or not UTF-8 fails alone); a file
    that cannot be opened raises `UserError`."""
    out = Path(out)
    with open_requests(str(requests)) as f:
        limit = MAX_BATCH_LINE_BYTES  # read here, so that a test can lower it
        total = count_requests(f, limit)
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        run = BatchRun(m, out, total)
        seen: dict[str, int] = {}
        count = 0
        try:
            for number, text in request_lines(f, limit):
                count += 1
                item = (BatchLine(number, f"line-{number}", error=text) if isinstance(text, RequestError)
                        else parse_line(m.plan, number, text, m.input_rate))
                run.submit(item, seen)
            while run.in_flight:
                run.collect(block=True)
        finally:
            run.bar.close()
    wall = time.perf_counter() - t0
    st = m.stats()
    summary = {
        "requests": count,
        "finished": run.finished,
        "failed": len(run.failures),
        "wall_s": round(wall, 3),
        "requests_per_s": round(count / wall, 2) if wall > 0 else 0.0,
        "steps": int(st["steps"]),
        "mean_batch": round(st["mean_batch"], 2),
        "wasted_steps": int(st["wasted_steps"]),
        "preemptions": int(st["preemptions"]),
        "cohort_steps": int(st.get("cohort_steps", 0)),  # decode cohort steps (0 where no marked loop ran as a cohort)
        "failures": sorted(run.failures, key=lambda f: f["line"]),
    }
    (out / f"{SUMMARY}.json").write_text(json.dumps(jsonable(summary), indent=2) + "\n", encoding="utf-8")
    print(f"requests: {summary['requests']}  finished: {summary['finished']}  failed: {summary['failed']}")
    print(f"wall time: {wall:.2f} s  throughput: {summary['requests_per_s']} requests/s")
    print(f"steps: {summary['steps']}  mean batch size: {summary['mean_batch']}  "
          f"wasted speculative steps: {summary['wasted_steps']}  preemptions: {summary['preemptions']}")
    print(f"summary -> {out / f'{SUMMARY}.json'}")
    return 1 if run.failures else 0


# ----------------------------------------------------------------------------- modes without click
def run_walk(plan: str | PathLike[str], walk: str, inputs: Mapping[str, str] | None = None, *,
             out: str | PathLike[str] = "out", stream: bool = False,
             options: EngineOptions | None = None) -> int:
    """`mstar-run PLAN --walk WALK --input k=v ...`: load the plan, parse `inputs` ({name:
    text}, as `--input` gives them) by the walk's types, run one request, write its files.
    Exit status; errors the user can fix are one `mstar-run: error:` line on stderr."""
    options = options or EngineOptions()
    return _guard(lambda: _walk(plan, walk, inputs or {}, out, stream, options))


def _walk(plan_path: str | PathLike[str], walk: str, texts: Mapping[str, str], out: str | PathLike[str],
          stream: bool, options: EngineOptions) -> int:
    plan = load_plan(plan_path, device=options.device)
    inputs = cli_inputs(plan, walk, texts, options.weights)  # before the weights load: a typo costs a second
    with start_engine(plan, options) as m:
        return one_shot(m, walk, inputs, out, stream)


def run_requests(plan: str | PathLike[str], requests: str | PathLike[str], out: str | PathLike[str], *,
                 options: EngineOptions | None = None) -> int:
    """`mstar-run PLAN --requests FILE.jsonl --out DIR`: load the plan, run the batch. Exit status."""
    options = options or EngineOptions()

    def go() -> int:
        with start_engine(load_plan(plan, device=options.device), options) as m:
            return batch(m, requests, out)

    return _guard(go)


def run_server(plan: str | PathLike[str], config: ServeConfig | None = None, *,
               options: EngineOptions | None = None, engine_process: bool = False) -> int:
    """`mstar-run PLAN --serve`: bind the address first (a busy port is one line at once), load
    the plan, serve it until SIGTERM / SIGINT (`serve.server.serve`, on this, the main, thread).
    `config.weights` is set from `options.weights` (the chat route's tokenizer copy).
    `engine_process`: the engine runs in a child process (`mstar_runtime.engine_process`). Exit status."""
    from dataclasses import replace

    from mstar_runtime.serve.server import ListenError, ServeConfig, listen, missing_extra, serve

    options = options or EngineOptions()
    config = replace(config or ServeConfig(), weights=options.weights)
    missing = missing_extra()
    if missing is not None:
        return _error(missing)
    try:
        sock = listen(config.host, config.port)
    except ListenError as e:
        return _error(e)

    def checked() -> Plan:
        from mstar_runtime.plan.routes import RouteMisfit, served_routes

        loaded = load_plan(plan, device=options.device)  # a bad plan is one line here, before a process starts
        if options.prefix_caching:  # so is a prefix chunk the plan's pages do not divide
            check_prefix_chunk(DEFAULT_PREFIX_CHUNK if options.prefix_chunk is None else options.prefix_chunk,
                               loaded.page_size)
        try:  # a walk that does not fit a route it declares, too: before the weights load
            served_routes(loaded.walks)
        except RouteMisfit as e:
            raise UserError(f"{os.fspath(plan)}: {e}") from None
        return loaded

    def load() -> MStar:
        if not engine_process:
            return start_engine(checked(), options)
        from dataclasses import asdict

        from mstar_runtime.engine_process import EngineClient, EngineStartError

        loaded = checked()
        try:
            fields = {k: (str(v) if k == "weights" else v) for k, v in asdict(options).items()}
            return EngineClient.start(loaded, plan, fields)  # type: ignore[return-value]
        except EngineStartError as e:
            raise UserError(str(e)) from None

    try:
        m = _guard(load)
    except BaseException:
        sock.close()
        raise
    if isinstance(m, int):  # the plan or its weights failed: the error line is out
        sock.close()
        return m
    return serve(m, config, sock)


def _guard(fn: Callable[[], Any]) -> Any:
    """Run `fn`; what a user can fix becomes one error line and exit status 1, Ctrl-C 130."""
    try:
        return fn()
    except _startup_errors() as e:
        return _error(e)
    except UserError as e:
        return _error(e)
    except BrokenPipeError:  # stdout's reader went away (`mstar-run ... --stream | head`): no one to tell
        _drop_stdout()
        return 1
    except OSError as e:  # the output folder or a file read: missing permissions, a full disk
        where = f"'{e.filename}'" if e.filename else "the output files"
        return _error(f"cannot access {where}: {e.strerror or e}")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush at exit does not fail on
    the closed pipe again (Python's documented way to leave quietly after a BrokenPipeError)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # no real file descriptor behind stdout (a test's stand-in)
        return
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)


def _startup_errors() -> tuple[type[BaseException], ...]:
    """What loading can fail with for reasons the user can fix: a bad plan, weights or input,
    and a worker process that did not start (when the multi-rank runtime is installed)."""
    errors: tuple[type[BaseException], ...] = (PlanError, NodeError, RequestError, PrefixChunkError)
    try:
        from mstar_runtime.worker.remote import WorkerLost
    except ImportError:
        return errors
    return (*errors, WorkerLost)


def _error(e: BaseException | str) -> int:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 1


# ----------------------------------------------------------------------------- the command line
SERVER_OPTIONS = ("host", "port", "api_key", "access_log", "shutdown_timeout", "request_timeout", "served_model_name",
                  "engine_process")


def _pairs(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> dict[str, str]:
    try:
        return split_pairs(value)
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix("--input "), ctx, param) from None


def _check_usage(ctx: click.Context, p: Mapping[str, Any]) -> None:
    """What click's declarations cannot say: one mode, and options that belong to another."""
    modes = [flag for flag, on in (("--walk", p["walk"] is not None), ("--requests", p["requests"] is not None),
                                   ("--serve", p["serve"])) if on]
    if not modes:
        raise click.UsageError("one of --walk WALK, --requests FILE.jsonl or --serve is required", ctx)
    if len(modes) > 1:
        raise click.UsageError(f"{' and '.join(modes)} cannot be used together (one mode per run)", ctx)
    if p["requests"] is not None and not p["out"]:
        raise click.UsageError("--requests needs --out DIR", ctx)
    if p["inputs"] and p["walk"] is None:
        raise click.UsageError("--input goes with --walk (a batch file carries its own inputs)", ctx)
    if p["stream"] and p["walk"] is None:
        raise click.UsageError("--stream goes with --walk", ctx)
    _check_prefix_chunk_usage(ctx, p)
    if not p["serve"]:  # only what the command line set: an environment meant for a server may be set
        given = [f"--{name.replace('_', '-')}" for name in SERVER_OPTIONS
                 if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"server options go with --serve (got {', '.join(given)})", ctx)


def _check_prefix_chunk_usage(ctx: click.Context, p: Mapping[str, Any]) -> None:
    """A prefix chunk set without prefix caching would be ignored: refused, as vLLM refuses
    inconsistent flags. From the environment too, unless the command line turned caching off
    (an environment set up for caching, one run without it)."""
    if p["prefix_caching"]:
        return
    source, caching = ctx.get_parameter_source("prefix_chunk"), ctx.get_parameter_source("prefix_caching")
    if source is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--prefix-chunk goes with --prefix-caching (without it no prompt is chunked)", ctx)
    if source is click.core.ParameterSource.ENVIRONMENT and caching is not click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("MSTAR_PREFIX_CHUNK goes with --prefix-caching (MSTAR_PREFIX_CACHING=1); "
                               "set that too, or unset MSTAR_PREFIX_CHUNK", ctx)


def _env(name: str) -> dict[str, Any]:
    return {"envvar": name, "show_envvar": True}


@click.command(PROG, context_settings=CONTEXT_SETTINGS, epilog="Routes, errors, metrics and the server's "
               "options: docs/serving.md. Shell completion: eval \"$(_MSTAR_RUN_COMPLETE=bash_source mstar-run)\".")
@click.argument("plan", type=click.Path(dir_okay=False))
@click.option("--walk", metavar="WALK", help="Run one request of this walk.")
@click.option("--requests", type=click.Path(dir_okay=False), metavar="FILE.jsonl",
              help='Run a batch: one {"id", "walk", "inputs"} JSON object per line (examples/requests.jsonl).')
@click.option("--serve", is_flag=True, help="Serve the plan over HTTP: OpenAI-compatible and native routes.")
@click.option("--input", "-i", "inputs", multiple=True, metavar="K=V", callback=_pairs,
              help="An input of the walk, parsed by its declared type (tensors: a JSON list or @FILE, "
                   "a .safetensors, image or WAV file; images: @FILE.png|jpg). Repeatable.")
@click.option("--out", type=click.Path(file_okay=False), metavar="DIR",
              help="Where output files go (one-shot default: ./out).")
@click.option("--weights", default="dummy", show_default=True, metavar="DIR|dummy|init", **_env("MSTAR_WEIGHTS"),
              help="A folder of safetensors checkpoints, 'dummy' for seeded random weights, 'init' for "
                   "the modules' own initialisation.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), **_env("MSTAR_DEVICE"),
              help="Where to run (default: what the plan was compiled for).")
@click.option("--stream", is_flag=True, help="One-shot: print a line per streamed output chunk.")
@click.option("--threads", type=click.IntRange(min=1), metavar="N", **_env("MSTAR_THREADS"),
              help="torch CPU threads (default: torch's). Tiny CPU models run fastest with 1.")
@click.option("--host", default="127.0.0.1", show_default=True, metavar="HOST", **_env("MSTAR_HOST"),
              help="--serve: the address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, metavar="PORT",
              **_env("MSTAR_PORT"),
              help="--serve: the port (0: any free port).")
@click.option("--api-key", metavar="KEY", **_env("MSTAR_API_KEY"),
              help="--serve: every route but /health then wants 'Authorization: Bearer KEY' (401 otherwise).")
@click.option("--access-log/--no-access-log", default=True, show_default=True, **_env("MSTAR_ACCESS_LOG"),
              help="--serve: log one line per HTTP request (client, request, status, bytes, seconds).")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True, metavar="S",
              **_env("MSTAR_SHUTDOWN_TIMEOUT"),
              help="--serve: on SIGTERM, seconds in-flight requests get to finish before they are aborted.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), metavar="S",
              **_env("MSTAR_REQUEST_TIMEOUT"),
              help="--serve: fail a request that runs longer than this (finish reason 'timeout').")
@click.option("--served-model-name", metavar="NAME", **_env("MSTAR_SERVED_MODEL_NAME"),
              help="--serve: the model id clients name (default: the plan's model name).")
@click.option("--engine-process", is_flag=True, **_env("MSTAR_ENGINE_PROCESS"),
              help="--serve: run the engine in its own process, so HTTP streaming never holds up its steps.")
@click.option("--prefix-caching/--no-prefix-caching", default=False, show_default=True,
              **_env("MSTAR_PREFIX_CACHING"),
              help="Reuse the KV of prompts' shared leading blocks across requests (docs/runtime.md).")
@click.option("--prefix-chunk", type=click.IntRange(min=1), default=DEFAULT_PREFIX_CHUNK, show_default=True,
              metavar="N", **_env("MSTAR_PREFIX_CHUNK"),
              help="With --prefix-caching: prefill keyed prompts in chunks of N tokens (a multiple of the "
                   "plan's page size) and reuse cached KV up to a multiple of N, so a hit computes the same bits "
                   "as its miss (docs/runtime.md).")
@click.option("--window-gather", type=click.IntRange(0, MAX_WAIT), default=0, show_default=True, metavar="N",
              **_env("MSTAR_WINDOW_GATHER"),
              help="Let a codec window call (SNAC, Code2Wav) that is not full wait up to N engine steps for "
                   "other requests' windows to join it, while other work runs (0: off; docs/runtime.md).")
@click.option("--preempt-every", type=click.IntRange(min=1), hidden=True)  # debug: force preemptions
@version_option(PROG)
@click.pass_context
def command(ctx: click.Context, **p: Any) -> int:
    """Run the walks of a compiled M* plan: one request, a batch file, or a server."""
    _check_usage(ctx, p)
    options = EngineOptions(weights=p["weights"], device=p["device"], threads=p["threads"],
                            preempt_every=p["preempt_every"], prefix_caching=p["prefix_caching"],
                            prefix_chunk=p["prefix_chunk"] if p["prefix_caching"] else None,
                            window_gather=p["window_gather"],
                            request_timeout=p["request_timeout"] if p["serve"] else None)
    if p["walk"] is not None:
        return run_walk(p["plan"], p["walk"], p["inputs"], out=p["out"] or "out", stream=p["stream"],
                        options=options)
    if p["requests"] is not None:
        return run_requests(p["plan"], p["requests"], p["out"], options=options)
    from mstar_runtime.serve.server import ServeConfig

    config = ServeConfig(host=p["host"], port=p["port"], shutdown_timeout=p["shutdown_timeout"],
                         model_name=p["served_model_name"], api_key=p["api_key"] or None,
                         access_log=p["access_log"])
    return run_server(p["plan"], config, options=options, engine_process=p["engine_process"])


def main(argv: Sequence[str] | None = None) -> int:
    """The `mstar-run` console script: parse `argv` (default `sys.argv[1:]`), run, the exit status."""
    return run_command(command, PROG, argv)


__all__ = ["MAX_BATCH_LINE_BYTES", "BatchLine", "BatchRun", "EngineOptions", "UserError", "batch",
           "command", "count_requests", "main", "one_shot", "open_requests", "parse_line",
           "request_lines", "run_requests", "run_server", "run_walk", "start_engine"]


if __name__ == "__main__":
    sys.exit(main())
