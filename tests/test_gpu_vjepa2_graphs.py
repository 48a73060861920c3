"""On the GPU: the V-JEPA rollout step's CUDA-graph replays and the CEM's per-row FlashInfer attention.

- The GraphRunner alone, fixed blocks of Q = 34 tokens (not a multiple of the 16-token page:
  pad entries span two scratch-page copies and a part), two attention layers of 8 heads of
  64 in bf16: captured on the first call, then steps of other sizes (pad to buckets 1, 2, 4,
  8) and lengths, each replayed under torch's sync debug mode (copies, plan() and replay
  only: no host wait), static outputs poisoned with NaN before each replay, against
  `paged_attention` over the same writes.
- The predictor node at a reduced size (dim 512, 8 heads of 64 as the real one, 2 layers, 16
  frame tokens: 18 per step) in bf16 through three engines: the reference attention, eager
  FlashInfer, FlashInfer with CUDA graphs of `step`. Single-trajectory rollouts of 6 requests
  in batches that pad to buckets (one batch beyond the largest: eager) agree with the
  reference on every step's frame (relative L2 < 2e-2, as tests/test_gpu_graphs.py); every
  engine is fed the reference's outputs, so bf16 rounding cannot accumulate. A graphed step of
  the whole engine (node host code included) makes no host wait.
- CEM-like steps (64 and 9 trajectories as rows of two contexts): the node's per-row
  attention through FlashInfer (pages of one token, one plan per step) against the gathered
  keys and SDPA.
The real-size rollout through the compiled plan (graphs and per-row FlashInfer included) is
tests/test_vjepa2.py::test_real_size_bf16_parity.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import KVDriver, assert_graphed_agree, no_host_syncs, poison_graph_outputs, two_layers_vs_paged

from mstar_models.vjepa2.predictor import ACPredictor
from mstar_runtime.engine.engines import KVCacheEngine
from mstar_runtime.kv.attention import AttentionMetadata, KVPool, paged_attention
from mstar_runtime.kv.block_manager import BlockManager
from mstar_runtime.ops.node import NodeSpec

pytestmark = pytest.mark.gpu

PAGE, PAGES, BUCKETS = 16, 512, (1, 2, 4, 8)
TPF, ENC = 16, 256
PER = TPF + 2
PORTS = {"prefill": ("frame", "state"), "step": ("frame", "state")}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ------------------------------------------------------------------------------ the runner alone
def test_fixed_block_replays_equal_the_reference_and_never_sync(cuda: torch.device) -> None:
    from mstar_runtime.engine.graphs import GraphRunner
    from mstar_runtime.kv.flashinfer_backend import FlashInferBackend, graph_prefill

    q_tokens, scratch = 34, 255
    pool = KVPool(2, 256, PAGE, 8, 64, torch.bfloat16, cuda)
    pool.data.normal_()
    backend = FlashInferBackend(cuda)
    make = graph_prefill(backend, pool, None, q_tokens)
    assert make is not None
    runner = GraphRunner(pool, BUCKETS, make, scratch_page=scratch, capture=True, name="raw", tokens=q_tokens)
    def step(blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries whose contexts hold `blocks[i]` earlier blocks; each adds one more."""
        bm = BlockManager(scratch, PAGE)
        tables, slots, lens = [], [], []
        for i, m in enumerate(blocks):
            bm.append((f"r{i}", "main"), m * q_tokens)
            slots += bm.append((f"r{i}", "main"), q_tokens)
            tables.append(bm.page_table((f"r{i}", "main")))
            lens.append((m + 1) * q_tokens)
        n = len(blocks)
        meta = AttentionMetadata.build([q_tokens] * n, lens, tables, "block_causal", [q_tokens] * n)
        assert runner.accepts(meta, n)
        x = torch.randn(n * q_tokens, 8 * 64, device=cuda, dtype=torch.bfloat16)
        kv = torch.randn(n * q_tokens, 8 * 64, device=cuda, dtype=torch.bfloat16)
        if runner._state:
            poison_graph_outputs(runner)
        return two_layers_vs_paged(runner, pool, meta, slots, x, kv)

    for blocks in ([3, 0, 7], [1], [0, 5], [2, 2, 2, 2, 9, 0, 1, 4], [6, 1, 0, 3, 11], [12]):
        got, want = step(blocks)
        assert got.shape == want.shape and torch.isfinite(got).all(), blocks
        err = _rel(got, want)
        assert err < 2e-2, (blocks, err)
    assert runner.replays == 6 and runner.failed is None
    assert sorted(runner._state) == list(BUCKETS)


# ------------------------------------------------------------------------------ the predictor
def _predictor(device: torch.device, row_attention: str = "auto") -> ACPredictor:
    spec = NodeSpec(name="predictor", engine="kv", config={"tokens_per_frame": TPF, "max_steps": 16},
                    arch_args={"enc_dim": ENC, "dim": 512, "heads": 8, "depth": 2, "mlp": 1024},
                    settings={"max_steps": 16, "normalize_reps": True}, dtype=torch.bfloat16, device=device)
    node = ACPredictor(spec).eval()
    g = torch.Generator(device="cpu").manual_seed(11)
    with torch.no_grad():
        for name, p in node.named_parameters():
            gain = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_((torch.randn(p.shape, generator=g) * (0.05 if p.dim() > 1 else 0.02) + gain).to(p))
    node.row_attention = row_attention
    return node


@pytest.fixture
def engines(cuda: torch.device) -> dict[str, KVDriver]:
    from mstar_runtime.kv.flashinfer_backend import FlashInferBackend

    ref_node, fi_node = _predictor(cuda, "reference"), _predictor(cuda)
    fi_node.load_state_dict(ref_node.state_dict())
    return {
        "reference": KVDriver(KVCacheEngine(ref_node, PAGES, PAGE, torch.bfloat16, cuda,
                                            attention_backend=paged_attention, output_ports=PORTS), PAGES, PAGE),
        "eager": KVDriver(KVCacheEngine(fi_node, PAGES, PAGE, torch.bfloat16, cuda,
                                        attention_backend=FlashInferBackend(cuda), output_ports=PORTS), PAGES, PAGE),
        "graphs": KVDriver(KVCacheEngine(fi_node, PAGES, PAGE, torch.bfloat16, cuda,
                                         attention_backend=FlashInferBackend(cuda), output_ports=PORTS,
                                         graphs={"step": BUCKETS}), PAGES, PAGE),
    }


def _inputs(cuda: torch.device, g: torch.Generator, frames: int, rows: int, horizon: int) -> dict[str, torch.Tensor]:
    ctx = torch.nn.functional.layer_norm(torch.randn(frames, TPF, ENC, generator=g), (ENC,))
    hist = torch.randn(1, frames - 1, 7, generator=g).expand(rows, -1, -1)
    actions = torch.cat([hist, torch.randn(rows, horizon, 7, generator=g)], dim=1) * 0.05
    return {"frames": ctx.to(cuda, torch.bfloat16), "states": torch.rand(frames, 7, generator=g).to(cuda),
            "actions": actions.to(cuda)}


def test_rollout_step_graphs_equal_eager_flashinfer_and_the_reference(engines: dict[str, KVDriver],
                                                                      cuda: torch.device) -> None:
    runner = engines["graphs"].engine.graph_runners["step"]
    assert runner.capture and runner.tokens == PER and runner.buckets == list(BUCKETS)
    g = torch.Generator().manual_seed(12)
    reqs = {f"r{i}": _inputs(cuda, g, 1 + i % 3, 1, 8) for i in range(10)}
    carry: dict[str, dict[str, torch.Tensor]] = {}
    for name, d in engines.items():
        outs = d.step("prefill", [(r, x) for r, x in reqs.items()])
        if name == "reference":
            carry = {r: o for r, o in zip(reqs, outs)}
    # 3 (bucket 4), 1, 2, 10 (beyond 8: eager), 5 (8), 8, 7 (8)
    groups = [[0, 1, 2], [3], [4, 5], list(range(10)), [0, 1, 3, 4, 6], list(range(2, 10)), [5, 6, 7, 8, 9, 0, 1]]
    replays = 0
    for step, group in enumerate(groups):
        items = [(f"r{i}", {"frame": carry[f"r{i}"]["frame"], "state": carry[f"r{i}"]["state"],
                            "actions": reqs[f"r{i}"]["actions"]}) for i in group]
        if runner._state:
            poison_graph_outputs(runner)
        results = {name: d.step("step", items) for name, d in engines.items()}
        replays += len(group) <= max(BUCKETS)
        assert_graphed_agree(results, "frame", f"step {step} ({len(group)} entries)")
        for name in ("eager", "graphs"):
            state = torch.cat([o["state"] for o in results[name]])
            torch.testing.assert_close(state, torch.cat([o["state"] for o in results["reference"]]))
        carry.update({f"r{i}": o for i, o in zip(group, results["reference"])})
    assert runner.failed is None and runner.replays == replays
    # pad entries wrote the scratch page only: the graphed engine's real pages match the eager one's
    a, b = engines["graphs"].engine.pool.data[:, :PAGES].float(), engines["eager"].engine.pool.data.float()
    assert _rel(a, b) < 2e-2


def test_a_graphed_engine_step_never_syncs(engines: dict[str, KVDriver], cuda: torch.device) -> None:
    """The whole graphed step: engine bookkeeping, the node's host code (inputs already on the
    device, as carried outputs are), padding, plan and replay, under torch's sync debug mode."""
    d = engines["graphs"]
    g = torch.Generator().manual_seed(13)
    reqs = {f"r{i}": _inputs(cuda, g, 2, 1, 8) for i in range(3)}
    carry = {r: o for r, o in zip(reqs, d.step("prefill", list(reqs.items())))}
    for step in range(4):
        items = [(r, {"frame": carry[r]["frame"], "state": carry[r]["state"], "actions": x["actions"]})
                 for r, x in reqs.items()]
        # from step 2: after the capture (step 0) and one replay that warmed the host allocator
        with no_host_syncs(step >= 2):
            outs = d.step("step", items)
        carry = {r: o for r, o in zip(reqs, outs)}
    runner = d.engine.graph_runners["step"]
    assert runner.replays == 4 and runner.failed is None
    with torch.inference_mode():
        assert torch.isfinite(torch.cat([o["frame"] for o in carry.values()]).float()).all()


def test_cem_rows_on_flashinfer_equal_the_reference(engines: dict[str, KVDriver], cuda: torch.device) -> None:
    from mstar_runtime.kv.flashinfer_backend import FlashInferRowPrefill

    g = torch.Generator().manual_seed(14)
    reqs = {"cem": _inputs(cuda, g, 1, 64, 3), "hist": _inputs(cuda, g, 3, 9, 3)}
    drivers = {k: engines[k] for k in ("reference", "eager")}
    carry: dict[str, dict[str, Any]] = {}
    for name, d in drivers.items():
        outs = d.step("prefill", list(reqs.items()))
        if name == "reference":
            carry = dict(zip(reqs, outs))
    for step in range(3):
        items = [(r, {"frame": carry[r]["frame"], "state": carry[r]["state"], "actions": x["actions"]})
                 for r, x in reqs.items()]
        results = {name: d.step("step", items) for name, d in drivers.items()}
        for i, r in enumerate(reqs):
            got, want = results["eager"][i]["frame"], results["reference"][i]["frame"]
            assert got.shape == want.shape == (reqs[r]["actions"].shape[0], TPF, ENC)
            assert torch.isfinite(got.float()).all()
            err = _rel(got, want)
            assert err < 2e-2, f"step {step} {r}: relative error {err:.2e}"
        carry = dict(zip(reqs, results["reference"]))
    eager = drivers["eager"]
    kernel = eager.engine.node._row_kernels[id(eager.engine.pool)]
    assert isinstance(kernel, FlashInferRowPrefill) and kernel.plans == 3  # not fallen back to the reference
