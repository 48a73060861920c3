"""Stateless-step graphs on the CPU (runtime/mstar_runtime/engine/stateless_graphs.py): bucketing, padding, static
buffers, slicing and the capture-once-per-bucket bookkeeping, with a fake graph that behaves
like a CUDA graph (static outputs, overwritten by every replay); and Orpheus' SNAC decode
through it, which must equal the plain eager engine. The real capture, the side stream and
the device-side code check run on the GPU (tests/test_gpu_graphs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from test_orpheus_snac import TINY, random_windows, seeded_node

from mstar_models.orpheus.snac_decoder import SnacDecoder, bad_code_report
from mstar_runtime.engine.engines import StatelessEngine, StepEntry
from mstar_runtime.engine.stateless_graphs import (
    GraphPhase,
    Prepared,
    StatelessGraphRunner,
    eager_capture,
    run_phase,
    stateless_graph_runners,
)
from mstar_runtime.ops.node import Batch, NodeError, NodeSpec, RequestError, StatelessNode

ROOT = Path(__file__).resolve().parent.parent
BUCKETS = (1, 2, 4, 8)
ATOL = 1e-5  # a padded batch may pick other conv blockings than the unpadded one (tests/test_orpheus_snac.py)


def _tensors(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


class FakeGraphs:
    """A stand-in for CUDA graphs: `capture` runs fn once into static outputs, and every replay
    reruns it on the same static inputs and copies the result into those outputs in place."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.static: dict[int, Any] = {}
        self.inputs: dict[int, list[torch.Tensor]] = {}

    def __call__(self, fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> Callable[[], Any]:
        size = inputs[0].shape[0]
        outputs = fn(*inputs)
        self.captured.append(size)
        self.static[size], self.inputs[size] = outputs, list(inputs)

        def replay() -> Any:
            for s, f in zip(_tensors(outputs), _tensors(fn(*inputs)), strict=True):
                s.copy_(f)
            return outputs

        return replay

    def poison(self) -> None:
        with torch.inference_mode():  # the engine captures under inference mode, like the GPU
            for out in self.static.values():
                for t in _tensors(out):
                    t.fill_(float("nan"))


# ------------------------------------------------------------------------- a toy phase
class Toy(StatelessNode):
    """y = tanh(x @ w) + idx-th row of a table: a tensor input, an index input, two outputs."""

    def __init__(self) -> None:
        super().__init__(NodeSpec("toy", "stateless", {}, {}, {}, torch.float32, torch.device("cpu")))
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(6, 3, generator=g)
        self.table = torch.randn(5, 3, generator=g)
        self.calls = 0

    def embed_phase(self) -> GraphPhase:
        return GraphPhase(torch.device("cpu"), self._prepare, self._fn, self._finish)

    def graph_phase(self, phase: str) -> GraphPhase | None:
        return self.embed_phase() if phase == "embed" else None

    def phase_embed(self, batch: Batch) -> Batch:
        return run_phase(self.embed_phase(), batch)

    def _prepare(self, batch: Batch) -> Prepared:
        return Prepared((torch.stack([e["x"] for e in batch]), torch.tensor([e["i"] for e in batch])))

    def _fn(self, x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        y = torch.tanh(x @ self.w) + self.table[i]
        return y, y.sum(dim=1)

    @staticmethod
    def _finish(batch: Batch, out: tuple[torch.Tensor, torch.Tensor]) -> Batch:
        return [{"y": y, "s": s} for y, s in zip(*out)]


def toy_batch(n: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(6, generator=g), "i": int(torch.randint(0, 5, (1,), generator=g))} for _ in range(n)]


def toy_runner(capture: Any = None) -> tuple[Toy, StatelessGraphRunner, FakeGraphs]:
    node = Toy()
    fake = FakeGraphs()
    runner = StatelessGraphRunner(node.embed_phase(), [8, 1, 4, 2, 4], capture or fake, name="toy")
    return node, runner, fake


def test_buckets_and_acceptance() -> None:
    _, runner, _ = toy_runner()
    assert runner.buckets == [1, 2, 4, 8] and runner.max_bucket == 8
    assert [runner.bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 0)] == [1, 2, 4, 8, 8, None, None]
    assert runner.accepts(3) and not runner.accepts(9) and not runner.accepts(0)
    with pytest.raises(ValueError, match="positive"):
        StatelessGraphRunner(Toy().embed_phase(), [0, 2], eager_capture)
    with pytest.raises(ValueError, match="side stream needs a cuda device"):
        StatelessGraphRunner(Toy().embed_phase(), [1], eager_capture, side_stream=True)
    with pytest.raises(ValueError, match="cuda device"):
        stateless_graph_runners(Toy(), {"embed": (1,)}, capture=True)


def test_padded_replays_equal_the_plain_phase() -> None:
    node, runner, fake = toy_runner()
    for step, n in enumerate([3, 1, 4, 2, 9, 8, 3, 5]):
        batch = toy_batch(n, seed=step)
        fake.poison()  # a replay must recompute every row it returns
        got = runner.run_phase(batch)
        want = node.phase_embed(batch)
        assert len(got) == n
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g["y"], w["y"]) and torch.equal(g["s"], w["s"])
    assert fake.captured == [8, 4, 2, 1]  # every bucket once, largest first, on the first step
    assert runner.replays == 7 and runner.captures == 4  # 9 entries ran eagerly


def test_outputs_are_copies_that_survive_the_next_replay() -> None:
    _, runner, fake = toy_runner()
    first = runner.run_phase(toy_batch(3, seed=1))
    kept = [o["y"].clone() for o in first]
    runner.run_phase(toy_batch(4, seed=2))  # same bucket: overwrites its static outputs
    static_y = fake.static[4][0]
    for o, k in zip(first, kept, strict=True):
        assert torch.equal(o["y"], k)
        assert o["y"].untyped_storage().data_ptr() != static_y.untyped_storage().data_ptr()


def test_pad_rows_are_zeros_and_real_rows_land_in_the_static_buffers() -> None:
    _, runner, fake = toy_runner()
    runner.run_phase(toy_batch(4, seed=3))
    batch = toy_batch(3, seed=4)
    runner.run_phase(batch)
    x, i = fake.inputs[4]
    assert torch.equal(x[:3], torch.stack([e["x"] for e in batch])) and i[:3].tolist() == [e["i"] for e in batch]
    assert not x[3].any() and int(i[3]) == 0  # the pad row: zeros, not the previous step's row


def test_input_and_output_checks() -> None:
    node, runner, _ = toy_runner()
    runner.run_phase(toy_batch(2, seed=5))
    with pytest.raises(NodeError, match="one row per entry"):
        runner.run(node._fn, (torch.zeros(2, 6), torch.zeros(3, dtype=torch.long)))
    with pytest.raises(NodeError, match="changed shape or dtype"):
        runner.run(node._fn, (torch.zeros(2, 7), torch.zeros(2, dtype=torch.long)))
    with pytest.raises(ValueError, match="does not take 9 rows"):
        runner.run(node._fn, (torch.zeros(9, 6), torch.zeros(9, dtype=torch.long)))
    _, bad, _ = toy_runner()
    with pytest.raises(NodeError, match="one row per entry, got \\(\\)"):
        bad.run(lambda x, i: x.sum(), (torch.zeros(2, 6), torch.zeros(2, dtype=torch.long)))


def test_a_failed_capture_answers_eagerly_and_turns_the_runner_off(caplog: pytest.LogCaptureFixture) -> None:
    def broken(fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> Callable[[], Any]:
        raise RuntimeError("operation not permitted when stream is capturing")

    node, runner, _ = toy_runner(capture=broken)
    batch = toy_batch(3, seed=6)
    with caplog.at_level(logging.WARNING, logger="mstar_runtime.engine.stateless_graphs"):
        got = runner.run_phase(batch)
    assert "capture failed" in caplog.text and runner.failed is not None
    for g, w in zip(got, node.phase_embed(batch), strict=True):
        assert torch.equal(g["y"], w["y"])
    assert not runner.accepts(1) and runner.replays == 0
    assert len(runner.run_phase(toy_batch(2, seed=7))) == 2  # eager from now on


def test_engine_wiring(caplog: pytest.LogCaptureFixture) -> None:
    eng = StatelessEngine(Toy(), {"embed": ("y", "s")}, graphs={"embed": BUCKETS}, capture_graphs=False)
    runner = eng.graph_runners["embed"]
    assert not runner.side_stream and runner.capture is eager_capture
    out = eng.run("embed", [StepEntry(f"r{i}", None, e) for i, e in enumerate(toy_batch(3, seed=8))])
    assert len(out) == 3 and runner.replays == 1

    class Opaque(StatelessNode):  # no graph_phase: the plan's graphs for it are ignored
        def phase_embed(self, batch: Batch) -> Batch:
            return [{"y": e["x"]} for e in batch]

    with caplog.at_level(logging.INFO, logger="mstar_runtime.engine.stateless_graphs"):
        plain = StatelessEngine(Opaque(Toy().spec), {"embed": ("y",)}, graphs={"embed": BUCKETS})
    assert plain.graph_runners == {} and "no graph_phase" in caplog.text
    assert plain.run("embed", [StepEntry("r", None, {"x": torch.ones(2)})])[0]["y"].tolist() == [1, 1]
    # a phase the node does not offer gets no runner either
    assert StatelessEngine(Toy(), graphs={"other": BUCKETS}, capture_graphs=False).graph_runners == {}


# -------------------------------------------------------------------------------- SNAC
@pytest.fixture(scope="module")
def snac() -> SnacDecoder:
    return seeded_node(TINY, seed=3)


def snac_entries(n: int, seed: int) -> list[StepEntry]:
    windows = random_windows(n, seed)
    return [StepEntry(f"r{i}", None, {"codes": w, "codes:context": 21, "codes:final": False, "seed": seed + i,
                                      "codes:index": i})
            for i, w in enumerate(windows)]


def test_snac_graphed_engine_equals_the_eager_engine(snac: SnacDecoder) -> None:
    ports = {"decode": ("pcm",)}
    fake = FakeGraphs()
    plain = StatelessEngine(snac, ports)
    graphed = StatelessEngine(snac, ports, graphs={"decode": BUCKETS}, capture_graphs=fake)
    runner = graphed.graph_runners["decode"]
    sizes = [1, 3, 2, 8, 5, 9, 4, 3]
    for step, n in enumerate(sizes):
        entries = snac_entries(n, seed=100 + step)  # fresh windows, seeds and chunk indices every step
        fake.poison()
        got = torch.stack([o["pcm"] for o in graphed.run("decode", entries)])
        want = torch.stack([o["pcm"] for o in plain.run("decode", entries)])
        assert got.shape == (n, 2048) and torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert fake.captured == [8, 4, 2, 1] and runner.replays == len(sizes) - 1
    windows, words = fake.inputs[4]
    assert windows.dtype == words.dtype == torch.int64 and windows.shape == (4, 28) and words.shape == (4, 3)
    assert not windows[3].any() and not words[3].any()  # the last step's pad row: code 0, key words 0


@pytest.mark.parametrize("bad", [-1, 4096, 70000])
def test_snac_bad_codes_fail_before_the_graph(snac: SnacDecoder, bad: int) -> None:
    fake = FakeGraphs()
    graphed = StatelessEngine(snac, {"decode": ("pcm",)}, graphs={"decode": BUCKETS}, capture_graphs=fake)
    entries = snac_entries(3, seed=7)
    entries[1].inputs["codes"] = entries[1].inputs["codes"].clone()
    entries[1].inputs["codes"][5] = bad
    with pytest.raises(RequestError, match=rf"codes must lie in \[0, 4096\); got {bad}") as e:
        graphed.run("decode", entries)
    assert e.value.field == "codes" and fake.captured == []  # host codes are checked on the host, first


def test_bad_code_report_names_the_first_bad_code_per_window() -> None:
    w = torch.zeros(4, 28, dtype=torch.int32)
    w[1, 3], w[1, 9] = 5000, -2
    w[2, 27] = -7
    w[3, 0] = 4095
    assert bad_code_report(w, 4096).tolist() == [[0, 0], [1, 5000], [1, -7], [0, 0]]
    assert bad_code_report(w.long() + 2**40, 4096).tolist()[0] == [1, 2**40]  # no int32 wrap


def test_snac_clamps_codes_inside_the_tensor_part(snac: SnacDecoder) -> None:
    """A window whose deferred (device) check rejects it still decodes without an index error."""
    w = random_windows(2, seed=9).long()
    bad = w.clone()
    bad[0, 0], bad[1, 5] = 9999, -3
    words = torch.zeros(2, 3, dtype=torch.long)
    with torch.inference_mode():
        out = snac.decode_windows(bad, words)
        clamped = snac.split_layers(bad)
    assert out.shape == (2, 2048) and torch.isfinite(out).all()
    assert int(clamped[0][0, 0]) == 4095 and int(clamped[1][1].min()) >= 0
    assert [c.tolist() for c in snac.split_layers(w)] == [c.tolist() for c in snac.split_layers(w.int())]


def test_orpheus_tts_through_padded_snac_graphs_equals_the_plain_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end (tiny Orpheus, CPU): concurrent requests whose SNAC windows go through a
    fake-graph runner (batches of 1..4, padded) give the audio of the plain engine."""
    from mstar_runtime.api import MStar
    from mstar_runtime.worker import worker as worker_mod
    from mstarc.cli import main as mstarc

    plan = tmp_path / "orpheus.plan"
    assert mstarc(["compile", str(ROOT / "models/orpheus/orpheus.walk"), "--variant", "tiny",
                   "-p", str(ROOT / "placements/cpu.yaml"), "-o", str(plan)]) == 0
    requests = [{"text": f"Graph number {i}.", "max_tokens": 40 + 5 * i, "seed": i} for i in range(4)]

    def run_all() -> list[torch.Tensor]:
        with MStar.load(plan) as m:
            handles = [m.submit("tts", r) for r in requests]
            return [h.result()["audio"] for h in handles]

    plain = run_all()
    runners: list[StatelessGraphRunner] = []

    def graphed_engine(module: StatelessNode, output_ports: Any = None, graphs: Any = None) -> StatelessEngine:
        assert graphs is None  # a CPU worker asks for none; force them for SNAC
        if not isinstance(module, SnacDecoder):
            return StatelessEngine(module, output_ports)
        eng = StatelessEngine(module, output_ports, graphs={"decode": (1, 2, 4)}, capture_graphs=FakeGraphs())
        runners.append(eng.graph_runners["decode"])
        return eng

    monkeypatch.setattr(worker_mod, "StatelessEngine", graphed_engine)
    graphed = run_all()
    assert len(runners) == 1 and runners[0].replays > 0
    assert max(runners[0]._state) > 1  # windows of several requests were batched
    for a, b in zip(plain, graphed, strict=True):
        assert a.shape == b.shape and a.numel() >= 2048
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
