"""`mstarc`: check, compile, explain and diff M* plans (click).

    mstarc check   MODEL.walk [-p PLACEMENT.yaml] [--variant NAME] [--weights DIR|dummy]
    mstarc compile MODEL.walk -p PLACEMENT.yaml [--variant NAME] [--weights DIR|dummy] -o PLAN
                   [--verify-each] [--print-after PASS] [--time-passes]
    mstarc explain PLAN [--format text|markdown|dot|json]
    mstarc diff    PLAN_A PLAN_B
    mstarc --version

Exit status: 0 success, 1 a user error (diagnostics on stderr: `FILE:LINE:COL:
error[CODE]: message`, the source line and a caret), 2 bad usage, 3 an internal compiler
error (which names the pass). `diff` exits as diff(1) does: 0 equal plans, 1 different
plans, 2 trouble (a plan that cannot be read or used, bad usage, an internal error). Never a traceback for
user input. `--variant`, `-p` and `--weights` also read `MSTAR_VARIANT`, `MSTAR_PLACEMENT`
and `MSTAR_WEIGHTS`; shell completion: `eval "$(_MSTARC_COMPLETE=bash_source mstarc)"`.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click

from mstar_runtime import untrusted
from mstar_runtime.cli_support import CONTEXT_SETTINGS, run_command, version_option
from mstar_runtime.plan import check, planfile
from mstarc import ir as I
from mstarc.diagnostics import CompileError, Diagnostic, InternalError, SourceCache, Span, render, render_all

EXIT_OK, EXIT_USER, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_DIFFERENT, EXIT_TROUBLE = 1, 2  # `mstarc diff`, as diff(1): a script tells "differ" from "failed"


def _display(path: str) -> str:
    """Paths in diagnostics and plans are relative: plans must not depend on where they were built."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return rel if not rel.startswith("..") else path


@contextlib.contextmanager
def _phase(name: str, *passthrough: type[Exception]) -> Iterator[None]:
    """A front-end phase: a user error passes through, anything else is a compiler bug naming it."""
    try:
        yield
    except (CompileError, InternalError, *passthrough):
        raise
    except Exception as e:  # noqa: BLE001 - reported as E090, never as a traceback
        raise InternalError(name, f"{type(e).__name__}: {e}") from e


def _frontend(args: SimpleNamespace) -> tuple[I.ModelIR, str, object | None]:
    """Parse, lower (with weights) and load the placement: the inputs of the pipeline."""
    from mstarc import checkpoint
    from mstarc.lower import lower
    from mstarc.parser import parse, read_source

    src = _display(args.model)
    data, text = read_source(args.model, src)  # read once: the digest is of the bytes parsed
    with _phase("parse"):
        model_ast = parse(text, src)
    weights_dir: Path | None = None
    ck = I.CheckpointIR("none")
    if args.weights in ("dummy", "init"):  # no checkpoint to check (`init`: mstar-run's module init)
        ck = I.CheckpointIR("dummy")
    elif args.weights:
        try:
            with _phase("checkpoint", checkpoint.CheckpointError):
                ck = checkpoint.scan(args.weights)
        except checkpoint.CheckpointError as e:
            raise CompileError([Diagnostic("E062", str(e), Span(src, 0, 0), "pass a folder of .safetensors files")]) from None
        weights_dir = Path(args.weights)
    with _phase("lower"):
        model = lower(model_ast, args.variant, src, weights_dir, ck)
    with _phase("checkpoint"):
        if weights_dir is not None:
            try:
                model = checkpoint.with_subdirs(model, weights_dir)
            except checkpoint.CheckpointError as e:
                raise CompileError([Diagnostic("E062", str(e), Span(src, 0, 0),
                                               "pass a folder of .safetensors files")]) from None
        problems = checkpoint.compare(model)
    if problems:
        raise CompileError(problems)
    spec = None
    if getattr(args, "placement", None):
        from mstarc.placement import load_placement
        with _phase("placement"):
            spec = load_placement(args.placement, _display(args.placement))
    digest = hashlib.sha256(data).hexdigest()
    return model, digest, spec


def cmd_check(args: SimpleNamespace) -> int:
    from mstarc import pipeline

    model, _, spec = _frontend(args)
    until = "memory" if spec is not None else "verify"
    model = pipeline.run(model, spec, until=until, verify_each=args.verify_each)
    _warn(model)
    walks = ", ".join(sorted(model.walks)) or "none"
    where = f" on {args.placement}" if spec is not None else ""
    print(f"ok: model '{model.name}' ({model.variant}){where}: {len(model.nodes)} nodes, "
          f"{len(model.edges)} edges, walks {walks}")
    return EXIT_OK


def cmd_compile(args: SimpleNamespace) -> int:
    from mstarc import pipeline
    from mstarc.plan import build_plan

    bad = [p for p in args.print_after if p not in pipeline.PIPELINE]
    if bad:
        print(f"mstarc: error: --print-after: unknown pass '{bad[0]}' (passes: {', '.join(pipeline.PIPELINE)})",
              file=sys.stderr)
        return EXIT_USAGE
    model, digest, spec = _frontend(args)
    model = pipeline.run(model, spec, verify_each=args.verify_each, print_after=frozenset(args.print_after),
                         time_passes=args.time_passes)
    _warn(model)
    with _phase("plan"):
        body = build_plan(model, digest)
        problems = check.check_body(body)  # the schema the runtime's loader checks
        if problems:
            raise InternalError("plan", f"the plan body breaks the plan schema: {'; '.join(problems[:5])}")
    try:
        size = planfile.write(args.output, body)
    except planfile.PlanFileError as e:
        raise CompileError([Diagnostic("E072", str(e), Span(_display(args.model), 0, 0))]) from None
    except OSError as e:
        print(f"mstarc: error: cannot write '{args.output}': {e.strerror or e}", file=sys.stderr)
        return EXIT_USER
    except Exception as e:  # noqa: BLE001 - a body that does not encode is a compiler bug
        raise InternalError("plan", f"{type(e).__name__}: {e}") from e
    print(f"wrote {args.output}: model '{model.name}' ({model.variant}), {len(model.placement.ranks)} rank(s), "
          f"{size} bytes")
    return EXIT_OK


def _read_plan(path: str) -> dict:
    """A plan's body, checked against the plan schema as the runtime's loader checks it: a
    body edited and re-checksummed is E070 (each problem, naming its field), not E090."""
    try:
        body = planfile.read(path)
    except planfile.PlanFileError as e:
        if e.kind == "io":
            raise CompileError([Diagnostic("E004", e.message, Span(path, 0, 0))]) from None
        code = {"version": "E071", "size": "E072"}.get(e.kind, "E070")
        raise CompileError([Diagnostic(code, e.message, Span(path, 0, 0))]) from None
    problems = check.check_body(body)
    if problems:
        raise CompileError([Diagnostic("E070", f"invalid plan: {p}", Span(path, 0, 0),
                                       "the plan was changed after mstarc wrote it; recompile it") for p in problems])
    return body


def cmd_explain(args: SimpleNamespace) -> int:
    from mstarc.explain import explain

    plan = _read_plan(args.plan)
    with _phase("explain", RecursionError):
        try:
            text = explain(plan, args.format)
        except RecursionError:  # deeper than any plan mstarc writes (blocks nest at most 64 deep)
            raise CompileError([Diagnostic("E070", "plan nests too deeply to explain: the file is corrupt",
                                           Span(args.plan, 0, 0))]) from None
    print(text, end="")
    return EXIT_OK


def cmd_diff(args: SimpleNamespace) -> int:
    from mstarc.diff import diff_plans

    a, b = _read_plan(args.plan_a), _read_plan(args.plan_b)
    with _phase("diff", RecursionError):
        try:
            changes = diff_plans(a, b)
        except RecursionError:  # deeper than any plan mstarc writes
            raise CompileError([Diagnostic("E070", "plans nest too deeply to compare: a file is corrupt",
                                           Span(args.plan_a, 0, 0))]) from None
    if not changes:
        print("plans are equal")
        return EXIT_OK
    print(untrusted.printable(f"--- {args.plan_a}\n+++ {args.plan_b}"))
    print(untrusted.printable("\n".join(changes)))
    return EXIT_DIFFERENT


def _model_options(placement_required: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options of `check` and `compile`: the model, its placement, variant and weights."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed((
            click.argument("model", metavar="MODEL.walk", type=click.Path(dir_okay=False)),
            click.option("-p", "--placement", metavar="PLACEMENT.yaml", type=click.Path(dir_okay=False),
                         required=placement_required, envvar="MSTAR_PLACEMENT", show_envvar=True,
                         help="The placement file (which devices hold which nodes)."),
            click.option("--variant", default="real", show_default=True, envvar="MSTAR_VARIANT", show_envvar=True,
                         help="Config variant."),
            click.option("--weights", metavar="DIR|dummy", envvar="MSTAR_WEIGHTS", show_envvar=True,
                         help="Checkpoint folder (safetensors) to check the walk's tensors against, or dummy."),
            click.option("--verify-each", is_flag=True, help="Check IR invariants after every pass."),
        )):
            fn = option(fn)
        return fn

    return wrap


@click.group("mstarc", context_settings=CONTEXT_SETTINGS,
             epilog="Diagnostics: docs/diagnostics.md. Shell completion: "
                    "eval \"$(_MSTARC_COMPLETE=bash_source mstarc)\".")
@version_option("mstarc")
def command() -> None:
    """The M* compiler: .walk + placement -> plan."""


@command.command("check")
@_model_options(placement_required=False)
def _check(**kw: Any) -> int:
    """Check a model (and a placement) without writing a plan."""
    return _run(cmd_check, kw)


@command.command("compile")
@_model_options(placement_required=True)
@click.option("-o", "--output", required=True, metavar="PLAN", type=click.Path(dir_okay=False),
              help="Where the plan file goes.")
@click.option("--print-after", multiple=True, metavar="PASS", help="Print the IR after PASS (repeatable).")
@click.option("--time-passes", is_flag=True, help="Print each pass's time.")
def _compile(**kw: Any) -> int:
    """Compile a model for a placement into a plan file."""
    return _run(cmd_compile, {**kw, "print_after": list(kw["print_after"])})


@command.command("explain")
@click.argument("plan", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option("--format", type=click.Choice(["text", "markdown", "dot", "json"]), default="text", show_default=True)
def _explain(**kw: Any) -> int:
    """Render a plan for humans."""
    return _run(cmd_explain, kw)


@command.command("diff")
@click.argument("plan_a", metavar="PLAN_A", type=click.Path(dir_okay=False))
@click.argument("plan_b", metavar="PLAN_B", type=click.Path(dir_okay=False))
def _diff(**kw: Any) -> int:
    """Semantic diff of two plans; exit 0 equal, 1 different, 2 trouble."""
    return _run(cmd_diff, kw, trouble=EXIT_TROUBLE)


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """A compile allocates many small containers (arch tensor lists, the IR graph) that all
    live until it ends; Python's default thresholds would run the cyclic collector over
    them again and again (a fifth of the corpus's compile time). Inputs are bounded
    (mstarc/limits.py), so collecting less often is safe; the thresholds are restored."""
    before = gc.get_threshold()
    gc.set_threshold(50_000, 50, 50)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _run(fn: Callable[[SimpleNamespace], int], kw: dict[str, Any], trouble: int | None = None) -> int:
    """Run one subcommand; diagnostics and internal errors become their exit status (both
    `trouble` when given: `diff`, whose 1 means "different")."""
    args = SimpleNamespace(**kw)
    sources = SourceCache()
    try:
        with _fewer_collections():
            return fn(args)
    except CompileError as e:
        errors = [d for d in e.diagnostics if d.severity == "error"]
        print(render_all(e.diagnostics, sources), file=sys.stderr)
        return (EXIT_USER if trouble is None else trouble) if errors else EXIT_OK
    except InternalError as e:
        print(f"mstarc: error[E090]: {e}\n(this is a bug in mstarc, not in your input)", file=sys.stderr)
        return EXIT_INTERNAL if trouble is None else trouble
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    """The `mstarc` console script: parse `argv` (default `sys.argv[1:]`), run, the exit status.
    Bad usage raises `SystemExit(2)` after printing the usage and `mstarc: error: ...`."""
    return run_command(command, "mstarc", argv)


def _warn(model: I.ModelIR) -> None:
    sources = SourceCache()
    for w in model.warnings:
        print(render(w, sources), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
