"""On the GPU: CUDA-graph decode replays equal eager FlashInfer steps and the reference.

Three engines serve the same bf16 GQA model (the test family's TinyLM at head_dim 128, its
decode forward going through `attn.run_graphed`): the reference attention (eager), FlashInfer
eagerly, and FlashInfer with CUDA graphs per batch bucket. Decode steps of varying batch size
(some padded, one beyond the largest bucket, so eager) must agree on the hidden states, and
the graphs' static outputs are filled with NaN before every replay, so a replay that did not
recompute a row is caught. Each model step feeds all three engines the reference's tokens,
so bf16 rounding cannot make them diverge.

Stateless steps (runtime/mstar_runtime/engine/stateless_graphs.py), on the real-size SNAC decoder in fp32: graph
replays at buckets 1, 4 (3 rows, padded) and 16 equal the eager engine on fresh random codes
each run, static outputs poisoned with NaN before each replay, with the codes on the host or
on the device and the replay on the side stream or the current one; a step from host codes
makes no host wait and its side-stream replay runs while earlier work of the current stream
is still queued; a bad device-resident code fails its request and the GPU keeps working.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support import KVDriver, assert_graphed_agree, no_host_syncs, poison_graph_outputs, two_layers_vs_paged

from mstar_models.testfamily import TinyLM
from mstar_models.testfamily.family import CONFIGS, node_spec
from mstar_runtime.engine.engines import KVCacheEngine, StepEntry
from mstar_runtime.kv.attention import paged_attention
from mstar_runtime.kv.block_manager import BlockManager
from mstar_runtime.ops.node import AttentionContext, Batch

pytestmark = pytest.mark.gpu

PAGE, PAGES, BUCKETS = 16, 256, (1, 2, 4, 8, 16)
PORTS = {"prefill": ("token", "code", "done"), "decode": ("token", "code", "done"), "denoise": ("v",)}
CONFIG = {**CONFIGS["tiny"], "hidden": 256, "heads": 8, "kv_heads": 2, "head_dim": 128, "intermediate": 512,
          "max_context": 4096, "max_new_tokens": 4096}


class GraphedTinyLM(TinyLM):
    def phase_decode(self, batch: Batch, attn: AttentionContext) -> Batch:
        ids = torch.cat([entry["token"] for entry in batch]).long()
        hidden = attn.run_graphed(
            lambda i, p: self.forward_hidden(self.model.embed_tokens(i), p, attn.attend), ids, attn.positions()
        )
        return self._next_tokens(hidden, attn)


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["tensor-core-decode", "cuda-core-decode"])
def test_graph_replays_equal_eager_and_reference(cuda: torch.device, tensor_cores: bool) -> None:
    from mstar_runtime.kv.flashinfer_backend import FlashInferBackend

    spec = node_spec("lm", CONFIG, cuda, torch.bfloat16)
    ref_lm = GraphedTinyLM(spec).eval()
    engines = {
        "reference": KVCacheEngine(ref_lm, PAGES, PAGE, torch.bfloat16, cuda, attention_backend=paged_attention,
                                   output_ports=PORTS),
        "eager": KVCacheEngine(ref_lm, PAGES, PAGE, torch.bfloat16, cuda, output_ports=PORTS,
                               attention_backend=FlashInferBackend(cuda, graph_tensor_cores=tensor_cores)),
        "graphs": KVCacheEngine(ref_lm, PAGES, PAGE, torch.bfloat16, cuda, output_ports=PORTS,
                                attention_backend=FlashInferBackend(cuda, graph_tensor_cores=tensor_cores),
                                graphs={"decode": BUCKETS}),
    }
    runner = engines["graphs"].graph_runners["decode"]
    assert runner.capture
    drivers = {name: KVDriver(e, PAGES, PAGE) for name, e in engines.items()}
    g = torch.Generator().manual_seed(7)
    n = 20
    prompts = [torch.randint(16, 272, (int(torch.randint(1, 200, (1,), generator=g)),), generator=g).to(cuda)
               for _ in range(n)]
    tokens = {}
    for name, d in drivers.items():
        outs = d.step("prefill", [(f"r{i}", {"tokens": p, "max_new": 4000}, len(p)) for i, p in enumerate(prompts)])
        if name == "reference":
            tokens = {f"r{i}": o["token"] for i, o in enumerate(outs)}
    groups = [[0, 1, 2], list(range(5)), [7], list(range(20)), [3, 9], list(range(16)), list(range(11))] * 6
    replays = 0
    for step, group in enumerate(groups):
        items = [(f"r{i}", {"token": tokens[f"r{i}"]}, 1) for i in group]
        if runner._state:  # after the first capture: poison every static output before its replay
            poison_graph_outputs(runner)
        results = {name: d.step("decode", items) for name, d in drivers.items()}
        replays += len(group) <= max(BUCKETS)
        assert_graphed_agree(results, "hidden", f"step {step} ({len(group)} rows)")
        tokens.update({f"r{i}": o["token"] for i, o in zip(group, results["reference"])})
    assert runner.failed is None and runner.replays == replays
    # pad rows wrote the scratch page only: the real pages of the graphed engine match the eager one's
    a, b = engines["graphs"].pool.data[:, :PAGES].float(), engines["eager"].pool.data.float()
    assert ((a - b).norm() / b.norm()) < 2e-2


def test_a_column_step_with_other_ports_is_not_replayed(cuda: torch.device) -> None:
    """TinyLM's decode is a column step (ops/column_call.py): its captured graph reads each
    input where the captured entries' ports put it (sorted by name: 'a' before 'token'). A step
    whose entries carry 'z' instead ('token' first) would replay with 'z' read as the token;
    it runs eagerly instead, and agrees with the reference."""
    from mstar_runtime.kv.flashinfer_backend import FlashInferBackend

    lm = TinyLM(node_spec("lm", CONFIG, cuda, torch.bfloat16)).eval()
    engines = {
        "reference": KVCacheEngine(lm, PAGES, PAGE, torch.bfloat16, cuda, attention_backend=paged_attention,
                                   output_ports=PORTS),
        "eager": KVCacheEngine(lm, PAGES, PAGE, torch.bfloat16, cuda, output_ports=PORTS,
                               attention_backend=FlashInferBackend(cuda)),
        "graphs": KVCacheEngine(lm, PAGES, PAGE, torch.bfloat16, cuda, output_ports=PORTS,
                                attention_backend=FlashInferBackend(cuda), graphs={"decode": BUCKETS}),
    }
    runner = engines["graphs"].graph_runners["decode"]
    drivers = {name: KVDriver(e, PAGES, PAGE) for name, e in engines.items()}
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(16, 272, (20 + 7 * i,), generator=g).to(cuda) for i in range(3)]
    tokens = {}
    for name, d in drivers.items():
        outs = d.step("prefill", [(f"r{i}", {"tokens": p, "max_new": 4000}, len(p)) for i, p in enumerate(prompts)])
        if name == "reference":
            tokens = {f"r{i}": o["token"] for i, o in enumerate(outs)}
    for step, (extra, replays) in enumerate((("a", 1), ("z", 1), ("a", 2))):
        items = [(rid, {"token": t, extra: torch.full_like(t, 7)}, 1) for rid, t in tokens.items()]
        results = {name: d.step("decode", items) for name, d in drivers.items()}
        assert runner.replays == replays, (step, extra)
        assert_graphed_agree(results, "hidden", f"step {step} (extra port '{extra}')")
        tokens = {rid: o["token"] for rid, o in zip(tokens, results["reference"], strict=True)}
    assert runner.renamed == 1 and runner.failed is None


def test_a_replayed_step_equals_the_reference_and_never_syncs(cuda: torch.device) -> None:
    """The runner alone (no node): capture on the first call, then a step with other lengths and
    another bucket, replayed under torch's sync debug mode -- copies, plan() and replay only."""
    from mstar_runtime.engine.graphs import GraphRunner
    from mstar_runtime.kv.attention import AttentionMetadata, KVPool
    from mstar_runtime.kv.flashinfer_backend import FlashInferBackend

    pages, scratch = 128, 127
    pool = KVPool(2, pages, PAGE, 8, 128, torch.bfloat16, cuda)
    pool.data.normal_()
    backend = FlashInferBackend(cuda)
    make = backend.graph_decoder(pool, None)
    assert make is not None
    runner = GraphRunner(pool, (1, 2, 4, 8), make, scratch_page=scratch, capture=True, name="raw")
    def step(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        bm = BlockManager(scratch, PAGE)
        tables, slots = [], []
        for i, n in enumerate(lens):
            slots.append(bm.append((f"r{i}", "main"), n)[-1])
            tables.append(bm.page_table((f"r{i}", "main")))
        meta = AttentionMetadata.build([1] * len(lens), lens, tables)
        x = torch.randn(len(lens), 24 * 128, device=cuda, dtype=torch.bfloat16)
        kv = torch.randn(len(lens), 8 * 128, device=cuda, dtype=torch.bfloat16)
        return two_layers_vs_paged(runner, pool, meta, slots, x, kv)

    for lens in ([5, 17, 300], [1, 2, 3, 4, 5, 6, 7], [40], [33, 1500]):
        got, want = step(lens)
        assert torch.isfinite(got).all()
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 2e-2, (lens, float(err))
    assert runner.replays == 4 and runner.failed is None


# ------------------------------------------------------------------ stateless: SNAC window decode
@pytest.fixture(scope="module")
def snac_gpu() -> Iterator[Any]:
    """The real-size SNAC decoder (13M parameters, seeded weights) in fp32 on the GPU, TF32 off
    so that a padded batch and the unpadded one differ only in summation order."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from test_orpheus_snac import REAL, seeded_node

    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield seeded_node(REAL, seed=31, device="cuda")
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def _snac_entries(n: int, g: torch.Generator, where: str, bad_at: int | None = None) -> list[StepEntry]:
    windows = torch.randint(0, 4096, (n, 28), generator=g, dtype=torch.int32)
    if bad_at is not None:
        windows[bad_at, 11] = 9999
    if where == "device":
        windows = windows.cuda()
    seeds = torch.randint(0, 2**62, (n,), generator=g).tolist()
    return [StepEntry(f"r{i}", None, {"codes": w, "codes:context": 21, "codes:final": False, "seed": s,
                                      "codes:index": i}) for i, (w, s) in enumerate(zip(windows, seeds))]


def _poison(runner: Any) -> None:
    with torch.inference_mode():  # the captured outputs are inference tensors
        for out in runner.capture.outputs:
            for t in out if isinstance(out, tuple) else (out,):
                t.fill_(float("nan"))


@pytest.mark.parametrize("side_stream", [True, False], ids=["side-stream", "current-stream"])
@pytest.mark.parametrize("where", ["host", "device"])
def test_snac_window_decode_graph_replay_equals_eager(snac_gpu: Any, where: str, side_stream: bool) -> None:
    """Buckets 1, 4 (a batch of 3, padded) and 16, fresh random codes each run, static outputs
    poisoned with NaN before every replay; codes on the host (no device sync) or the device."""
    from mstar_runtime.engine.engines import StatelessEngine

    ports = {"decode": ("pcm",)}
    eager = StatelessEngine(snac_gpu, ports)
    graphed = StatelessEngine(snac_gpu, ports, graphs={"decode": (1, 2, 4, 8, 16)}, side_stream=side_stream)
    runner = graphed.graph_runners["decode"]
    assert runner.side_stream == side_stream and runner.capture.__class__.__name__ == "CudaGraphCapture"
    g = torch.Generator().manual_seed(5)
    sizes = [1, 3, 16] * 3
    for step, n in enumerate(sizes):
        entries = _snac_entries(n, g, where)
        _poison(runner)
        got = torch.stack([o["pcm"] for o in graphed.run("decode", entries)])
        want = torch.stack([o["pcm"] for o in eager.run("decode", entries)])
        assert got.shape == (n, 2048) and torch.isfinite(got).all(), f"step {step} ({n} rows)"
        err = float((got - want).norm() / want.norm())
        assert err < 1e-4, f"step {step} ({n} rows): relative error {err:.2e}"
    assert runner.failed is None and runner.captures == 5 and runner.replays == len(sizes)
    assert sorted(runner._state) == [1, 2, 4, 8, 16]  # all captured on the first step


def test_snac_replay_from_host_codes_never_syncs_and_overlaps_the_current_stream(snac_gpu: Any) -> None:
    """Host codes: prepare, uploads, replay and clone-out without a host wait; on the side stream
    the replay does not wait for work queued earlier on the current stream."""
    import time

    from mstar_runtime.engine.engines import StatelessEngine

    graphed = StatelessEngine(snac_gpu, {"decode": ("pcm",)}, graphs={"decode": (1, 2, 4)})
    runner = graphed.graph_runners["decode"]
    assert runner.side_stream
    g = torch.Generator().manual_seed(6)
    first = graphed.run("decode", _snac_entries(2, g, "host"))  # captures every bucket
    # once more, so that the caching allocators (pinned host, side stream) hold blocks of these sizes
    first += graphed.run("decode", _snac_entries(2, g, "host"))
    torch.cuda.synchronize()
    entries = _snac_entries(2, g, "host")
    torch.cuda._sleep(int(1e9))  # ~0.5 s of GPU time queued on the current stream
    queued = torch.cuda.Event()
    queued.record()
    with no_host_syncs(drain=False):
        out = graphed.run("decode", entries)
    side_done = False
    while not queued.query():
        side_done = side_done or runner._side.query()
        time.sleep(0.001)
    assert side_done, "the side-stream replay waited for the current stream's earlier work"
    with torch.inference_mode():
        assert torch.isfinite(torch.stack([o["pcm"] for o in out + first])).all()


def test_snac_bad_device_code_fails_its_request_and_the_gpu_survives(snac_gpu: Any) -> None:
    from mstar_runtime.engine.engines import StatelessEngine
    from mstar_runtime.ops.node import RequestError

    graphed = StatelessEngine(snac_gpu, {"decode": ("pcm",)}, graphs={"decode": (1, 2, 4)})
    g = torch.Generator().manual_seed(7)
    with pytest.raises(RequestError, match=r"codes must lie in \[0, 4096\); got 9999") as e:
        graphed.run("decode", _snac_entries(3, g, "device", bad_at=1))  # decoded clamped, then rejected
    assert e.value.field == "codes"
    out = graphed.run("decode", _snac_entries(3, g, "device"))
    torch.cuda.synchronize()  # a device-side index error would surface here
    with torch.inference_mode():
        assert torch.isfinite(torch.stack([o["pcm"] for o in out])).all()
