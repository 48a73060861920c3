"""Whisper-large-v3 (random weights, real size) on the generic step path (the plan without its
cohort marks) against the decode cohort, eager and graphed, and against transformers in float32 on the same weights: token
agreement pairwise, and where each first differs.

    python tools/probes/whisper_paths.py            # one H200

The same two clips as tests/test_gpu_whisper.py (30 s and 12.5 s of seeded noise, English,
64 tokens each), through one Worker: a Conductor on the plan without its cohort marks
(`without_cohorts`: the generic path), then one on the plan as compiled (the cohort path) with `MSTAR_COHORT_GRAPHS=0` (eager FlashInfer), then one with graphs (the worker's
cohort columns are dropped between them, so each opens its own). A bug of one path shows as
its agreement with the others (and with float32) far below the bf16 noise between the rest.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mstar_models.whisper.features import N_SAMPLES, log_mel, mel_filters  # noqa: E402
from mstar_runtime.control.conductor import FINISHED, Conductor  # noqa: E402
from mstar_runtime.plan.loader import load_plan, without_cohorts  # noqa: E402
from mstar_runtime.worker.worker import COHORT_GRAPHS_ENV, Worker  # noqa: E402
from mstarc.cli import main as mstarc  # noqa: E402
from tests.whisper_reference import from_nodes  # noqa: E402

TOKENS = 64


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=False)) / max(len(a), len(b), 1)


def main() -> None:
    out = Path(tempfile.mkdtemp()) / "whisper.plan"
    assert mstarc(["compile", str(ROOT / "models/whisper/whisper.walk"), "--variant", "real",
                   "-p", str(ROOT / "placements/h200x1.yaml"), "-o", str(out)]) == 0
    plan = load_plan(out, device="cuda")
    worker = Worker(plan, 0, "cuda", "dummy")
    audio = [torch.randn(int(s * 16000), generator=torch.Generator().manual_seed(i)) * 0.1
             for i, s in enumerate((30.0, 12.5))]
    runs: dict[str, list[list[int]]] = {}
    real_open = Worker.cohort_open
    for name, path, graphs, math in (("generic", "generic", "1", ""), ("cohort eager", "cohort", "0", ""),
                                     ("cohort graphed", "cohort", "1", ""),
                                     ("cohort eager, reads by decode_attention", "cohort", "0", "reads"),
                                     ("cohort eager, all by decode_attention", "cohort", "0", "all")):
        os.environ[COHORT_GRAPHS_ENV] = graphs
        worker._cohorts.clear()  # each cohort run opens its own columns (and graphs, or none)
        worker._cohort_engine.clear()

        def cohort_open(self: Worker, *args: object, math: str = math) -> bool:
            ok = real_open(self, *args)
            for cols in self._cohorts.values():  # the float32 reference math instead of FlashInfer
                cols.eager_reads = [None] * len(cols.reads) if math else cols.eager_reads
                cols.eager_attention = None if math == "all" else cols.eager_attention
            return ok

        Worker.cohort_open = cohort_open  # type: ignore[method-assign]
        conductor = Conductor(plan if path == "cohort" else without_cohorts(plan), {0: worker})
        hs = [conductor.submit("transcribe", {"audio": a, "language": "en", "max_tokens": TOKENS,
                                              "min_tokens": TOKENS}) for a in audio]
        conductor.run_until_idle()
        assert all(h.state == FINISHED for h in hs), [h.error for h in hs]
        runs[name] = [h.outputs["tokens"].tolist() for h in hs]
        print(name, "cohort steps", conductor.stats["cohort_steps"], flush=True)
    enc, dec = worker.engines["encoder"].node, worker.engines["decoder"].node
    cfg = dict(plan.config)
    filters = torch.from_numpy(mel_filters(int(cfg["mels"]))).float().cuda()
    padded = torch.stack([torch.nn.functional.pad(a, (0, N_SAMPLES - a.numel())) for a in audio]).cuda()
    feats = log_mel(padded, filters, torch.hann_window(400, device="cuda"))
    kw = dict(language="en", task="transcribe", max_new_tokens=TOKENS, min_new_tokens=TOKENS,
              force_unique_generate_call=True)
    with torch.no_grad():
        for name, dtype in (("transformers bf16", torch.bfloat16), ("transformers fp32", torch.float32)):
            ref = from_nodes(enc, dec, cfg, dtype=dtype)
            runs[name] = [s[-TOKENS:] for s in ref.generate(feats.to(dtype), **kw).tolist()]
            del ref
    names = list(runs)
    table = {f"{a} ~ {b}": [(round(agreement(x, y), 3), first_diff(x, y)) for x, y in zip(runs[a], runs[b])]
             for i, a in enumerate(names) for b in names[i + 1:]}
    print(json.dumps(table, indent=1))
    outdir = Path(os.environ.get("OUT", tempfile.gettempdir()))
    (outdir / "whisper_paths.json").write_text(json.dumps({"runs": runs, "agreement": table}, indent=1))


if __name__ == "__main__":
    main()
