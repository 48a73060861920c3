"""Tensor parallelism: Orpheus' Llama backbone at tp 2 over two Gloo ranks equals tp 1.

- the sharded layer math (runtime/mstar_runtime/ops/tp.py collectives, LlamaBackbone's column / row /
  vocab-parallel layers) over 2 processes: a column+row-parallel MLP equals the dense one,
  the gathered logits are in vocab order, and the backbone's tp 2 logits (dummy weights and
  its own `init` weights) are bit-identical on both ranks and equal tp 1's within float32
  tolerance, with the same argmax;
- end to end (tests/placements/cpu2_tp2.yaml: llm on ranks 0 and 1, snac on rank 0), a
  batch of greedy tts requests gives exactly the codes and audio of placements/cpu.yaml;
- on two GPUs (NCCL), the same greedy comparison (marked gpu and multigpu).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from mstar_runtime.control.conductor import FINISHED, Conductor
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.worker.startup import shutdown_workers, start_workers
from mstar_runtime.worker.worker import Worker
from mstarc.cli import main as mstarc

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # two ranks on a 2-core box: one thread each

# A few prompts of different lengths and budgets, batched together; greedy, so tp 1 and tp 2
# must pick the same token at every step.
REQUESTS: list[dict[str, Any]] = [
    {"text": "Hello there.", "voice": "tara", "max_tokens": 45, "temperature": 0.0, "seed": 1},
    {"text": "Tensor parallel speech, two ranks at once.", "voice": "leo", "max_tokens": 52,
     "temperature": 0.0, "seed": 2},
    {"text": "A third one.", "voice": "mia", "max_tokens": 38, "temperature": 0.0, "seed": 3},
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _compile(out: Path, placement: str, variant: str = "tiny") -> Path:
    args = ["compile", str(ROOT / "models/orpheus/orpheus.walk"), "--variant", variant,
            "-p", str(ROOT / placement), "-o", str(out)]
    assert mstarc(args) == 0
    return out


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    out = tmp_path_factory.mktemp("tp")
    return {
        1: _compile(out / "tp1.plan", "placements/cpu.yaml"),
        2: _compile(out / "tp2.plan", "tests/placements/cpu2_tp2.yaml"),
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- layer math
# Run by each of two processes (rank, port, tp1 plan, tp2 plan, out dir); writes
# rank<r>.safetensors. Rank 0 also computes the dense (tp 1) references.
_RANK_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from mstar_runtime.ops import tp
    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.weights import build_node, load_weights

    rank, port, plan1, plan2, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    p1, p2 = load_plan(plan1, device="cpu"), load_plan(plan2, device="cpu")
    groups = tp.build_groups(p2, rank)
    res = {}

    # A column+row-parallel MLP (gate/up cut by output features, down by input features).
    gen = torch.Generator().manual_seed(0)
    hidden, inter, n = 64, 128, 5
    x = torch.randn(n, hidden, generator=gen)
    gate, up = torch.randn(inter, hidden, generator=gen) * 0.1, torch.randn(inter, hidden, generator=gen) * 0.1
    down = torch.randn(hidden, inter, generator=gen) * 0.1
    cols = slice(rank * inter // 2, (rank + 1) * inter // 2)
    part = (F.silu(x @ gate[cols].T) * (x @ up[cols].T)) @ down[:, cols].T
    res["mlp"] = tp.all_reduce(part, groups["llm"])
    res["mlp_dense"] = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    # all_gather_last: rank r's columns land at r's place
    res["gather"] = tp.all_gather_last(torch.full((3, 4), float(rank)), groups["llm"], 2)

    def attend(layer, q, k, v):  # one causal sequence, grouped-query
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True)
        return o.transpose(0, 1)

    ids = torch.tensor([128259, 128000, 5, 900, 77000, 156000, 128266, 140000, 3, 128009])
    pos = torch.arange(ids.numel())

    def logits(plan, source, tp_rank, tp_size, group):
        node = build_node(plan, "llm", rank, "cpu", tp_rank, tp_size, tp_group=group)
        load_weights(node, plan, "llm", source)
        with torch.no_grad():
            return node.head(node.forward_hidden(ids, pos, attend)), node.kv_geometry.kv_heads

    for source in ("dummy", "init"):
        res[f"logits_{source}"], kv = logits(p2, source, rank, 2, groups["llm"])
        res["kv_heads"] = torch.tensor(kv)
        if rank == 0:
            res[f"logits_{source}_tp1"], _ = logits(p1, source, 0, 1, None)
    save_file({k: v.contiguous() for k, v in res.items()}, f"{out}/rank{rank}.safetensors")
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def layer_results(plans: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ranks")
    port = str(_free_port())
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(r), port, str(plans[1]), str(plans[2]),
                          str(out)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log
    return [load_file(str(out / f"rank{r}.safetensors")) for r in range(2)]


def test_column_row_parallel_mlp_equals_the_dense_one(layer_results: list[dict[str, Any]]) -> None:
    r0, r1 = layer_results
    torch.testing.assert_close(r0["mlp"], r0["mlp_dense"], rtol=1e-5, atol=1e-6)
    assert torch.equal(r0["mlp"], r1["mlp"])  # one reduced sum, the same bytes on both ranks
    want = torch.tensor([[0.0] * 4 + [1.0] * 4] * 3)
    assert torch.equal(r0["gather"], want) and torch.equal(r1["gather"], want)


@pytest.mark.parametrize("source", ["dummy", "init"])
def test_backbone_logits_at_tp2_equal_tp1(layer_results: list[dict[str, Any]], source: str) -> None:
    r0, r1 = layer_results
    tp2, tp1 = r0[f"logits_{source}"], r0[f"logits_{source}_tp1"]
    assert tp2.shape == tp1.shape == (10, 156940)
    assert int(r0["kv_heads"]) == int(r1["kv_heads"]) == 1  # 2 KV heads, one per rank
    assert torch.equal(tp2, r1[f"logits_{source}"])  # every rank samples from the same bytes
    torch.testing.assert_close(tp2, tp1, rtol=1e-4, atol=1e-5)
    assert torch.equal(tp2.argmax(-1), tp1.argmax(-1))


# --------------------------------------------------------------------------- end to end
def _tts(
    plan_path: Path, device: str, cap: int | None = None, requests: list[dict[str, Any]] = REQUESTS
) -> tuple[list[dict[str, Any]], Conductor]:
    plan = load_plan(plan_path, device=device, kv_pages_cap=cap)
    if plan.num_ranks == 1:
        workers: dict[int, Any] = {0: Worker(plan, 0, plan.torch_device(0), "dummy")}
    else:
        workers = start_workers(plan, "dummy", device)
        for w in workers.values():
            w.check_refs = True  # a member compares its own fed-back token with the leader's
    try:
        conductor = Conductor(plan, workers)
        handles = [conductor.submit("tts", dict(r)) for r in requests]
        conductor.run_until_idle()
    finally:
        shutdown_workers(workers)
    assert all(h.state == FINISHED for h in handles), [h.error for h in handles]
    return [h.outputs for h in handles], conductor


def _assert_same(tp1: list[dict[str, Any]], tp2: list[dict[str, Any]]) -> None:
    for i, (a, b) in enumerate(zip(tp1, tp2, strict=True)):
        assert a["codes"].numel() >= 28, i  # at least one SNAC window, so audio is compared too
        assert torch.equal(a["codes"], b["codes"]), (i, a["codes"].tolist(), b["codes"].tolist())
        assert a["audio"].numel() > 0 and torch.equal(a["audio"], b["audio"]), i


def test_greedy_tts_at_tp2_equals_tp1(plans: dict[int, Path]) -> None:
    (tp1, _), (tp2, conductor) = _tts(plans[1], "cpu"), _tts(plans[2], "cpu")
    _assert_same(tp1, tp2)
    # every decode ran as a cohort step on both ranks (tp_dispatch.TPCohort): each code but a
    # request's first (from its prefill) came from a row of one, whose fed-back token never
    # left its rank's columns (check_refs: rank 1 answered each step in full, equal to rank 0's)
    decodes = sum(int(o["codes"].numel()) - 1 for o in tp2)
    (cohort,) = conductor.cohorts.values()
    assert cohort.key[2] == (0, 1) and cohort.stats["row_steps"] >= decodes
    # each row's first fed token (its prefill's) joined rank 1's columns as a reference to
    # rank 1's own copy (check_refs: sent too, and compared there)
    assert conductor.tp.refs_sent >= len(REQUESTS)


def test_sampled_tts_at_tp2_keeps_the_ranks_in_step(plans: dict[int, Path]) -> None:
    """Sampling (temperature, top-p, repetition penalty): rank 1 draws with the same seeds from
    the same gathered logits, so its own token, which it feeds back into its own cohort columns
    instead of receiving rank 0's, is rank 0's token (check_refs makes rank 1 answer every
    cohort step in full, compared with rank 0's outputs)."""
    sampled = [dict(r, temperature=0.8, top_p=0.9, repetition_penalty=1.2) for r in REQUESTS]
    outputs, conductor = _tts(plans[2], "cpu", requests=sampled)
    assert all(o["codes"].numel() >= 28 for o in outputs)
    assert conductor.stats["cohort_steps"] > 0 and conductor.broken is None


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_greedy_tts_at_tp2_equals_tp1_on_gpus(tmp_path: Path) -> None:
    """NCCL for both the step transfers and the TP group; CUDA graphs as the plan says."""
    tp1 = _compile(tmp_path / "tp1.plan", "placements/h200x1.yaml")
    tp2 = _compile(tmp_path / "tp2.plan", "placements/h200x2_tp2.yaml")
    _assert_same(_tts(tp1, "cuda", cap=256)[0], _tts(tp2, "cuda", cap=256)[0])
