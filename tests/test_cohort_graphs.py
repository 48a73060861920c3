"""A decode cohort's padded, bucketed step (`CohortGraphs`) equals the same step run eagerly.

Two cohorts of one GQA model (the test family's TinyLM at head_dim 128) over two pools: one
eager with `decode_attention` over exactly the n live rows, one padded to batch buckets by
`CohortGraphs` (forward, greedy pick, stop flags, fed-back copy, K/V append and length update
over bucket rows, pad rows masked by the device row count and sent to the scratch page).
Rows join, leave (the last row moves into the hole) and the batch crosses buckets; each
step's fed tokens are the eager cohort's, so rounding cannot make the two diverge. The hidden
states agree, the padded cohort's real pages equal the eager one's (pad rows wrote only the
scratch page), and its host mirror of the lengths matches the device.

- on the CPU (default tier): the padded step runs eagerly (`capture=False`) with the
  reference attention planned from the same host arrays (`ReferenceCohortDecode`), fp32;
- on the GPU (`gpu`): one CUDA graph per bucket with FlashInfer's graph decode, bf16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar_models.testfamily import TinyLM
from mstar_models.testfamily.family import CONFIGS, node_spec
from mstar_runtime.engine.cohort_engine import CohortColumns, CohortGraphs, CohortShape, ReferenceCohortDecode
from mstar_runtime.engine.engines import KVCacheEngine, KVSlots, StepEntry
from mstar_runtime.kv.attention import paged_attention
from mstar_runtime.kv.block_manager import BlockManager

PAGE, PAGES, BUCKETS, ROWS = 16, 256, (1, 2, 4, 8), 8
PORTS = {"prefill": ("token", "code", "done", "hidden"), "decode": ("token", "code", "done", "hidden")}
CONFIG = {**CONFIGS["tiny"], "hidden": 256, "heads": 8, "kv_heads": 2, "head_dim": 128, "intermediate": 512,
          "max_context": 4096, "max_new_tokens": 4096}
SHAPE = CohortShape("decode", (("token", "token"),), (), ("token", "code", "done", "hidden"))


def test_padded_cohort_steps_equal_eager_ones_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    lm = TinyLM(node_spec("lm", CONFIG, cpu, torch.float32)).eval()
    engines = {name: KVCacheEngine(lm, PAGES, PAGE, torch.float32, cpu, attention_backend=paged_attention,
                                   output_ports=PORTS, graphs={"decode": BUCKETS}, capture_graphs=False)
               for name in ("eager", "graphs")}
    graphs = CohortGraphs(list(BUCKETS), PAGES, lambda b, m: ReferenceCohortDecode(engines["graphs"].pool, None),
                          capture=False)
    _drive(lm, engines, graphs, cpu, tol=1e-5)


@pytest.mark.gpu
def test_graphed_cohort_steps_equal_eager_ones(cuda: torch.device) -> None:
    from mstar_runtime.kv.flashinfer_backend import FlashInferBackend

    lm = TinyLM(node_spec("lm", CONFIG, cuda, torch.bfloat16)).eval()
    fi = FlashInferBackend(cuda)
    engines = {
        "eager": KVCacheEngine(lm, PAGES, PAGE, torch.bfloat16, cuda, attention_backend=paged_attention,
                               output_ports=PORTS, graphs={"decode": BUCKETS}, capture_graphs=False),
        "graphs": KVCacheEngine(lm, PAGES, PAGE, torch.bfloat16, cuda, attention_backend=fi,
                                output_ports=PORTS, graphs={"decode": BUCKETS}, capture_graphs=False),
    }
    _drive(lm, engines, CohortGraphs(list(BUCKETS), PAGES, fi.graph_decoder(engines["graphs"].pool, None)), cuda,
           tol=2e-2)


def _drive(lm: TinyLM, engines: dict[str, KVCacheEngine], graphs: CohortGraphs, device: torch.device,
           tol: float) -> None:
    cohorts = {name: CohortColumns(e.pool, lm.cohort_phase("decode"), SHAPE, ROWS, 4096 // PAGE + 1, device,
                                   scale=None, node="lm", q_heads=8, graphs=graphs if name == "graphs" else None)
               for name, e in engines.items()}
    blocks = {name: BlockManager(PAGES, PAGE) for name in engines}
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(16, 272, (int(torch.randint(5, 120, (1,), generator=g)),), generator=g).to(device)
               for _ in range(ROWS + 2)]

    def prefill(name: str, i: int) -> torch.Tensor:
        key = (f"r{i}", "main")
        slots = blocks[name].append(key, len(prompts[i]))
        entry = StepEntry(f"r{i}", None, {"tokens": prompts[i], "max_new": 4000},
                          KVSlots(0, len(prompts[i]), slots, blocks[name].page_table(key)))
        return engines[name].run("prefill", [entry])[0]["token"]

    rows: list[int] = []  # request index per row, the same in both cohorts

    def join(i: int) -> None:
        for name, c in cohorts.items():
            token = prefill(name, i)
            key = (f"r{i}", "main")
            c.join(len(rows), engines[name].state(f"r{i}", None), {"token": token}, {},
                   blocks[name].page_table(key), blocks[name].seq_len(key))
        rows.append(i)

    def leave(row: int) -> None:
        last = len(rows) - 1
        for c in cohorts.values():
            if row != last:
                c.move(last, row)
            c.n = last
        rows[row] = rows[last]
        rows.pop()

    plan = [("join", 0), ("step", 3), ("join", 1), ("join", 2), ("step", 20), ("join", 3), ("join", 4),
            ("step", 10), ("leave", 1), ("step", 5), ("join", 5), ("join", 6), ("join", 7), ("join", 8),
            ("step", 30), ("leave", 0), ("leave", 3), ("step", 12)]
    steps = 0
    for what, arg in plan:
        if what == "join":
            join(arg)
            continue
        if what == "leave":
            leave(arg)
            continue
        for _ in range(arg):
            n = len(rows)
            for name, c in cohorts.items():  # a page for every row whose next token starts one
                bm = blocks[name]
                need = [r for r in range(n) if c.host_lens[r] % PAGE == 0]
                pages = [bm.add_page((f"r{rows[r]}", "main")) for r in need]
                c.add_pages(np.array(need, dtype=np.int64), c.host_lens[need] // PAGE, np.array(pages, dtype=np.int64))
            out = {name: c.step(n) for name, c in cohorts.items()}
            ref, got = (out[name].arrays()["hidden"] for name in ("eager", "graphs"))
            assert np.isfinite(got).all(), f"step {steps} ({n} rows): non-finite hidden states"
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert err < tol, f"step {steps} ({n} rows): relative error {err:.2e}"
            # teacher forcing: both cohorts go on from the eager cohort's tokens
            cohorts["graphs"].fed["token"][:n].copy_(cohorts["eager"].fed["token"][:n])
            steps += 1
    assert graphs.replays == steps
    graphed = cohorts["graphs"]
    assert np.array_equal(graphed.host_lens[: len(rows)], graphed.lens[: len(rows)].cpu().numpy())
    for r, i in enumerate(rows):  # every live row's context: the same K/V in both pools
        length = int(graphed.host_lens[r])
        a = engines["graphs"].pool.gather(0, graphed.table.host[r].tolist(), length)[0].float()
        b = engines["eager"].pool.gather(0, cohorts["eager"].table.host[r].tolist(), length)[0].float()
        assert ((a - b).norm() / b.norm()) < tol, f"row {r} (request {i}): K differs"
