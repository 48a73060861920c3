"""Helpers the test files share instead of each holding a copy: compiling the corpus' walks,
a plan as a cohort or a generic run takes it, loading a tools/ script, summing Prometheus samples, a SIGALRM watchdog, a stand-in flashinfer, a float32 GPU, a transformers model saved as a checkpoint folder, a CUDA-graph capture, a KV engine driven
with a BlockManager as the conductor drives it."""

from __future__ import annotations

import contextlib
import importlib.util
import re
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from mstar_runtime.engine.engines import KVCacheEngine, KVSlots, StepEntry
from mstar_runtime.kv.block_manager import BlockManager
from mstar_runtime.plan.loader import Plan, without_cohorts

ROOT = Path(__file__).resolve().parent.parent


class Hung(BaseException):  # not an Exception: no `except Exception` in the toolchain may swallow it
    pass


@contextlib.contextmanager
def watchdog(seconds: int) -> Iterator[None]:
    """Raise Hung in the main thread if the block is still running after SECONDS."""

    def fire(signum, frame):  # noqa: ARG001 - signal handler signature
        raise Hung(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def compile_walk(out: Path, walk: str | Path, placement: str | Path = "placements/cpu.yaml", *,
                 variant: str | None = "tiny", weights: Path | None = None) -> Path:
    """`mstarc compile WALK --variant VARIANT -p PLACEMENT -o OUT [--weights W]`, asserting that it
    succeeds; relative paths are the repository root's, `variant=None` is the walk's default. Returns `out`."""
    from mstarc.cli import main

    args = ["compile", str(ROOT / walk), *(["--variant", variant] if variant is not None else []),
            "-p", str(ROOT / placement), "-o", str(out), *(["--weights", str(weights)] if weights else [])]
    assert main(args) == 0, f"mstarc {' '.join(args)} failed"
    return out


def compile_model(out: Path, model: str, placement: str | Path = "placements/cpu.yaml", *,
                  variant: str | None = "tiny", weights: Path | None = None) -> Path:
    """`compile_walk` of models/<model>/<model>.walk."""
    return compile_walk(out, f"models/{model}/{model}.walk", placement, variant=variant, weights=weights)


RUNS = ("cohort", "generic")  # a plan as compiled, and without its cohort marks (the reference)


def as_run(plan: Plan, run: str) -> Plan:
    """`plan` as run `run` of `RUNS` takes it: "cohort", as compiled (its marked loops run as
    decode cohorts); "generic", without its cohort marks (`without_cohorts`: every loop
    iteration by iteration), the reference a cohort run is compared with."""
    assert run in RUNS, run
    return plan if run == "cohort" else without_cohorts(plan)


def run_generate(c: Any, prompt: str, max_new: int = 4) -> Any:
    """The test family's `generate` walk for `prompt` on conductor `c`, run until idle: its
    handle, which must have finished."""
    from mstar_runtime.control.conductor import FINISHED

    h = c.submit("generate", {"prompt": prompt, "max_new": max_new})
    c.run_until_idle()
    assert h.state == FINISHED, h.error
    return h


def load_script(path: str | Path, name: str | None = None) -> ModuleType:
    """A script under tools/ (no package on sys.path) as a module named `name` (default: the file's
    stem), registered in sys.modules, where dataclasses look their module up."""
    path = ROOT / path
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def metric_total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s Prometheus samples (keys `name{labels}`) whose labels include `labels`,
    whatever other labels they carry (a `model_name`, say) and in whatever order."""
    out = 0.0
    for key, value in samples.items():
        head, _, rest = key.partition("{")
        if head == name and labels.items() <= dict(re.findall(r'(\w+)="([^"]*)"', rest)).items():
            out += value
    return out


def fake_flashinfer(monkeypatch: pytest.MonkeyPatch, decode: type, prefill: type) -> ModuleType:
    """A stand-in `flashinfer` module (for the test's duration) whose wrappers are `decode` and
    `prefill`, with the backend's CPU-pool refusal lifted, so its host side runs without a GPU."""
    from mstar_runtime.kv import flashinfer_backend

    mod = ModuleType("flashinfer")
    mod.__version__ = "fake"  # type: ignore[attr-defined]
    mod.BatchDecodeWithPagedKVCacheWrapper = decode  # type: ignore[attr-defined]
    mod.BatchPrefillWithPagedKVCacheWrapper = prefill  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr(flashinfer_backend, "unsupported", lambda pool: None)  # let the CPU pool through
    return mod


def cuda_fp32() -> torch.device:
    """The GPU for a float32 parity test (skips without one): TF32 off for matmuls and convs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda")


def saved_checkpoint(model: Any, tmp_path_factory: pytest.TempPathFactory, name: str = "ckpt") -> Path:
    """A fresh folder holding `model.save_pretrained` (a transformers model as its checkpoint)."""
    out = tmp_path_factory.mktemp(name)
    model.save_pretrained(out)
    return out


def capture(fn: Callable[..., Any], *args: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    """A CUDA graph of `fn(*args)` and its static output: one warm-up call on a side stream first
    (lazy initialisation must not be captured), then the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


@contextlib.contextmanager
def no_host_syncs(on: bool = True, *, drain: bool = True) -> Iterator[None]:
    """With `on`, CUDA's sync debug mode is "error" inside the block: a call that makes the host
    wait for the GPU raises. `drain` first waits for the work queued before the block (a test
    that queued work on purpose, to see that the block does not wait for it, passes False)."""
    if on:
        if drain:
            torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class KVDriver:
    """An engine plus the BlockManager a conductor would run beside it: one `main` KV context
    per request id, slots reserved as the conductor reserves them."""

    def __init__(self, engine: KVCacheEngine, pages: int, page: int):
        self.engine, self.blocks = engine, BlockManager(pages, page)
        self.node = engine.node

    def step(self, phase: str, items: list[tuple[str, dict[str, Any]]] | list[tuple[str, dict[str, Any], int]]
             ) -> list[dict[str, Any]]:
        """Run `phase` over (request id, inputs[, q_len]) items; without a q_len the node's
        `kv_plan` for the inputs' shapes gives it, its mask and its block size."""
        entries = []
        for rid, inputs, *q in items:
            if q:
                q_len, mask, block = q[0], "causal", None
            else:
                plan = type(self.node).kv_plan(phase, {k: tuple(v.shape) for k, v in inputs.items()}, self.node.spec)
                q_len, mask, block = plan.q_len, plan.mask, plan.block_size
            key = (rid, "main")
            start = self.blocks.seq_len(key) if key in self.blocks else 0
            slots = self.blocks.append(key, q_len)
            entries.append(StepEntry(rid, None, inputs, KVSlots(start, q_len, slots, self.blocks.page_table(key),
                                                                mask, block)))
        return self.engine.run(phase, entries)


def bound_layer_equals_paged(runner: Any, pool: Any, meta: Any, slots: list[int], q: torch.Tensor,
                             k: torch.Tensor) -> torch.Tensor:
    """One attention layer (keys = values = `k`) run through `runner.bind` equals the reference
    `paged_attention` over a copy of `pool` with the same writes; returns the runner's output."""
    from mstar_runtime.kv.attention import KVPool, paged_attention
    from mstar_runtime.ops.node import AttentionContext

    attn = AttentionContext([], lambda *a: None, pool.device)  # type: ignore[arg-type]

    def fn(q_rows: torch.Tensor, k_rows: torch.Tensor) -> torch.Tensor:
        return attn.attend(0, q_rows, k_rows, k_rows) * 1.0

    out = runner.bind(attn, meta, slots)(fn, q, k)
    ref_pool = KVPool(pool.num_layers, pool.num_pages, pool.page_size, pool.kv_heads, pool.head_dim,
                      pool.dtype, pool.device)
    ref_pool.data.copy_(pool.data)
    ref_pool.write(0, k, k, slots)
    torch.testing.assert_close(out, paged_attention(q, ref_pool, 0, meta), atol=1e-5, rtol=1e-5)
    return out


def two_layers_vs_paged(runner: Any, pool: Any, meta: Any, slots: list[int], x: torch.Tensor,
                               kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention layers over rows x [N, heads * head_dim] (keys = values = `kv`
    [N, kv_heads * head_dim]; the second layer's queries half the first's output) through
    `runner.bind`, and the reference: the same layers as `paged_attention` over a copy of `pool`
    taken before, with the same writes. A replay (the runner holds its graphs) runs inside
    `no_host_syncs`. Returns the runner's rows and the reference's, [N, heads * head_dim] each."""
    from mstar_runtime.kv.attention import KVPool, paged_attention
    from mstar_runtime.ops.node import AttentionContext

    n, dim = x.shape[0], pool.head_dim
    q, k = x.view(n, -1, dim), kv.view(n, pool.kv_heads, dim)
    attn = AttentionContext([], lambda *a: None, pool.device)  # type: ignore[arg-type]

    def fn(x_rows: torch.Tensor, kv_rows: torch.Tensor) -> torch.Tensor:
        rows = x_rows.shape[0]
        kv_ = kv_rows.view(rows, pool.kv_heads, dim)
        h = attn.attend(0, x_rows.view(rows, -1, dim), kv_, kv_)
        return attn.attend(1, h * 0.5, kv_, kv_).reshape(rows, -1)

    ref_pool = KVPool(pool.num_layers, pool.num_pages, pool.page_size, pool.kv_heads, pool.head_dim,
                      pool.dtype, pool.device)
    ref_pool.data.copy_(pool.data)
    bound = runner.bind(attn, meta, slots)
    with no_host_syncs(bool(runner._state)):
        got = bound(fn, x, kv)
    slot_t = torch.tensor(slots, device=pool.device)
    ref_pool.write(0, k, k, slot_t)
    h = paged_attention(q, ref_pool, 0, meta)
    ref_pool.write(1, k, k, slot_t)
    return got, paged_attention(h * 0.5, ref_pool, 1, meta).reshape(n, -1)


def poison_graph_outputs(runner: Any) -> None:
    """NaN into every static output `runner` (a GraphRunner) captured, before a replay: an output
    the replay leaves unwritten then shows. A runner that does not capture holds None there."""
    with torch.inference_mode():  # the captured outputs are inference tensors
        for b in runner._state.values():
            for t in b.outputs if isinstance(b.outputs, tuple) else (b.outputs,):
                if isinstance(t, torch.Tensor):
                    t.fill_(float("nan"))


def assert_graphed_agree(results: dict[str, list[dict[str, Any]]], port: str, where: str) -> None:
    """The `eager` and `graphs` engines' `port` outputs of one step against the `reference`
    engine's: finite, within a relative L2 error of 2e-2 (bf16). `where` names the step."""
    ref = torch.cat([o[port] for o in results["reference"]]).float()
    for name in ("eager", "graphs"):
        got = torch.cat([o[port] for o in results[name]]).float()
        assert torch.isfinite(got).all(), f"{where}: {name} gave non-finite values"
        err = float((got - ref).norm() / ref.norm())
        assert err < 2e-2, f"{where}: {name} relative error {err:.2e}"
