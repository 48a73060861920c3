"""The runtime side of issue 16's constructs, on CPU, through the compiled corpus walks of
models/vla/ and models/asr/ and their nodes (models/mstar_models/vla, models/mstar_models/asr):

- the loader's `requires` check (refuses a feature it does not implement, naming it) and
  its invariants on `reads`, tag bounds and streamed inputs;
- `kv_reads`: the engine's attention over other contexts against a dense reference; the
  VLA walk (an action expert attending to the VLM's prefix) and the ASR walk (a decoder
  attending to its text and its cross-attention context) end to end against dense
  computations written here, with the pools holding no more than the memory pass sized;
- `input_streams`: audio fed in parts while the walk runs gives what the whole input gives,
  with backpressure, cancellation, timeouts, preemption replay and a tag's `max_len`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mstar_models.asr.nodes import FRAMES_PER_TOKEN
from mstar_models.testfamily.lm import apply_rope, rope_tables
from mstar_runtime.api import MStar, RequestFailed
from mstar_runtime.control.conductor import Conductor
from mstar_runtime.engine.engines import KVCacheEngine, KVSlots, ReadSlots, StepEntry, link_peers
from mstar_runtime.kv.block_manager import BlockManager
from mstar_runtime.ops.node import AttentionContext, KVGeometry, KVNode, NodeSpec, RequestError, SeqPlan
from mstar_runtime.plan import planfile
from mstar_runtime.plan.loader import PlanError, load_plan
from mstar_runtime.worker.worker import Worker
from mstarc.cli import main as mstarc

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
THETA = 10000.0


def compile_walk(name: str, out: Path, placement: str | None = None) -> Path:
    if placement is None:
        where = ROOT / "placements/cpu.yaml"
    else:
        where = out.with_suffix(".yaml")
        where.write_text(placement)
    assert mstarc(["compile", str(ROOT / f"models/{name}/{name}.walk"), "--variant", "tiny", "-p", str(where),
                   "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("constructs")
    return {name: compile_walk(name, d / f"{name}.plan") for name in ("vla", "asr")}


@pytest.fixture(scope="module")
def vla(plans: dict[str, Path]) -> Iterator[MStar]:
    with MStar.load(plans["vla"]) as m:
        yield m


@pytest.fixture(scope="module")
def asr(plans: dict[str, Path]) -> Iterator[MStar]:
    with MStar.load(plans["asr"]) as m:
        yield m


def node(m: MStar, name: str) -> Any:
    return m.conductor.workers[0].engines[name].node  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- dense references
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D] over k/v [L, Hkv, D], written out (softmax of scaled scores)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.double()).to(q.dtype)


def qkv(layer: Any, attn: Any, x: torch.Tensor, heads: int, kv_heads: int, dim: int,
        rope: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
    n = x.shape[0]
    q = attn.q_proj(x).view(n, heads, dim)
    k = attn.k_proj(x).view(n, kv_heads, dim)
    v = attn.v_proj(x).view(n, kv_heads, dim)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    return q, k, v


def vlm_prefix(vlm: Any, prompt: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The backbone's K/V per layer for a prompt: a causal dense forward."""
    t = prompt.shape[0]
    h = vlm.model.embed_tokens(prompt.long())
    rope = rope_tables(torch.arange(t), vlm.head_dim, THETA)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    out = []
    for layer in vlm.model.layers:
        q, k, v = qkv(layer, layer.self_attn, layer.input_layernorm(h), vlm.heads, vlm.kv_heads, vlm.head_dim, rope)
        out.append((k, v))
        h = h + layer.self_attn.o_proj(attention(q, k, v, causal).reshape(t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return out


def pi0_time(t: float, dim: int) -> torch.Tensor:
    period = 4e-3 * (4.0 / 4e-3) ** torch.linspace(0, 1, dim // 2, dtype=torch.float64)
    angle = t * 2 * math.pi / period
    return torch.cat([angle.sin(), angle.cos()]).float()


def expert_velocity(ex: Any, prefix: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor,
                    t: float) -> torch.Tensor:
    """One denoise step: the action tokens attend to the whole prefix and to each other."""
    n, p = x.shape[0], prefix[0][0].shape[0]
    a = x @ ex.model.embed_tokens.weight
    h = ex.action_time_mlp_in(torch.cat([a, pi0_time(t, ex.hidden).expand(n, -1)], dim=-1))
    h = ex.action_time_mlp_out(torch.nn.functional.silu(h))
    rope = rope_tables(p + torch.arange(n), ex.head_dim, THETA)
    for layer, (pk, pv) in zip(ex.model.layers, prefix):
        q, k, v = qkv(layer, layer.self_attn, layer.input_layernorm(h), ex.heads, ex.kv_heads, ex.head_dim, rope)
        h = h + layer.self_attn.o_proj(attention(q, torch.cat([pk, k]), torch.cat([pv, v])).reshape(n, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return ex.model.norm(h) @ ex.lm_head.weight.T


def act_reference(m: MStar, prompt: torch.Tensor, seed: int) -> torch.Tensor:
    cfg = m.plan.config
    prefix = vlm_prefix(node(m, "vlm"), prompt)
    x = torch.randn(cfg["horizon"], cfg["action_dim"], generator=torch.Generator().manual_seed(seed))
    steps = cfg["flow_steps"]
    for i in range(steps):
        x = x - expert_velocity(node(m, "expert"), prefix, x, 1.0 - i / steps) / steps
    return x


def transcribe_reference(m: MStar, sound: torch.Tensor) -> torch.Tensor:
    """Chunk by chunk: encode, extend the cross context, decode until done or the chunk's budget."""
    cfg, enc, dec = m.plan.config, node(m, "encoder"), node(m, "decoder")
    s = dec.sizes
    heard: list[torch.Tensor] = []  # the encoder states of every chunk so far
    own: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(s.layers)]
    tokens: list[int] = []
    for start in range(0, sound.shape[0], cfg["chunk_samples"]):
        heard.append(enc.phase_encode([{"samples": sound[start : start + cfg["chunk_samples"]]}])[0]["states"])
        frames = sum(c.shape[0] for c in heard)
        for _ in range(cfg["tokens_per_chunk"]):
            pos = len(tokens)
            h = dec.model.embed_tokens(torch.tensor([tokens[-1] if tokens else dec.sot]))
            rope = rope_tables(torch.tensor([pos]), s.head_dim, THETA)
            for i, layer in enumerate(dec.model.layers):
                q, k, v = qkv(layer, layer.self_attn, layer.input_layernorm(h), s.heads, s.kv_heads, s.head_dim, rope)
                own[i].append((k, v))
                ks, vs = torch.cat([kv[0] for kv in own[i]]), torch.cat([kv[1] for kv in own[i]])
                h = h + layer.self_attn.o_proj(attention(q, ks, vs).reshape(1, -1))
                c = layer.encoder_attn
                states = torch.cat(heard)
                qc = c.q_proj(layer.encoder_attn_layer_norm(h)).view(1, s.heads, s.head_dim)
                kc = c.k_proj(states).view(-1, s.kv_heads, s.head_dim)
                vc = c.v_proj(states).view(-1, s.kv_heads, s.head_dim)
                h = h + c.o_proj(attention(qc, kc, vc).reshape(1, -1))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            token = int((dec.model.norm(h) @ dec.lm_head.weight.T).argmax())
            tokens.append(token)
            if token == dec.eot or len(tokens) >= frames // FRAMES_PER_TOKEN or len(tokens) >= dec.max_text:
                break
    return torch.tensor(tokens, dtype=torch.int32)


def audio(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- the loader
def test_loader_runs_the_features_it_implements_and_refuses_others(plans: dict[str, Path], tmp_path: Path) -> None:
    assert load_plan(plans["vla"]).body["requires"] == ["kv_reads"]
    assert load_plan(plans["asr"]).body["requires"] == ["kv_reads", "input_streams"]
    body = planfile.read(plans["asr"])
    body["requires"] = ["kv_reads", "speculative_teleport"]
    planfile.write(tmp_path / "p.plan", body)
    with pytest.raises(PlanError, match="requires speculative_teleport, which this runtime does not implement"):
        load_plan(tmp_path / "p.plan")
    body["requires"] = "kv_reads"
    planfile.write(tmp_path / "p.plan", body)
    with pytest.raises(PlanError, match="`requires` must be a list of feature names"):
        load_plan(tmp_path / "p.plan")


def _calls(body: dict[str, Any], walk: str) -> list[dict[str, Any]]:
    return [op for op in planfile.iter_ops(body["walks"][walk]["program"]) if op["op"] == "call"]  # type: ignore[misc]


def _read_own(body: dict[str, Any]) -> None:
    body["nodes"]["expert"]["phases"]["denoise"]["reads"] = [{"node": "expert", "tag": None}]
    next(c for c in _calls(body, "act") if c.get("reads"))["reads"] = [{"node": "expert", "tag": "main"}]


@pytest.mark.parametrize("model,break_it,message", [
    ("vla", _read_own, "reads its own context expert@main"),
    ("vla", lambda b: b["nodes"]["expert"]["phases"]["denoise"].update(reads=[{"node": "flow", "tag": None}]),
     "phase expert.denoise reads 'flow', which is not a kv node"),
    ("asr", lambda b: next(c for c in _calls(b, "transcribe") if c.get("reads")).pop("reads"),
     "decoder.step reads decoder@cross"),
    ("asr", lambda b: b["nodes"]["decoder"]["tag_max_len"].update(speech=4), "bounds tag 'speech' to max_len 4"),
    ("asr", lambda b: b["walks"]["transcribe"]["inputs"][0].update(stream="transcribe:nowhere"),
     "streams input 'audio' into 'transcribe:nowhere'"),
], ids=["own-context", "stateless-owner", "missing-reads", "unknown-tag-bound", "wrong-input-stream"])
def test_loader_checks_reads_bounds_and_streamed_inputs(plans: dict[str, Path], tmp_path: Path, model: str,
                                                       break_it: Any, message: str) -> None:
    body = planfile.read(plans[model])
    break_it(body)
    planfile.write(tmp_path / "p.plan", body)
    with pytest.raises(PlanError, match=message):
        load_plan(tmp_path / "p.plan")


# ---------------------------------------------------------------------- the engine's reads
class _Probe(KVNode):
    """Writes its queries' K/V and returns what the read attentions give (for the engine test)."""

    def __init__(self, spec: NodeSpec):
        super().__init__(spec)

    @property
    def kv_geometry(self) -> KVGeometry:
        return KVGeometry(2, 2, 8)

    @classmethod
    def kv_plan(cls, phase: str, shapes: Any, spec: NodeSpec) -> SeqPlan:
        return SeqPlan(q_len=shapes["q"][0])

    def phase_look(self, batch: list[dict[str, Any]], attn: AttentionContext) -> list[dict[str, Any]]:
        q, k, v = (torch.cat([e[n] for e in batch]) for n in ("q", "k", "v"))
        joint = attn.attend(1, q, k, v, over=("owner",))
        cross = attn.attend_to(1, q, "owner@main")
        return [{"joint": a, "cross": b} for a, b in zip(attn.split(joint), attn.split(cross))]


def _spec(name: str) -> NodeSpec:
    return NodeSpec(name, "kv", {}, {}, {}, torch.float32, torch.device("cpu"))


def test_engine_attends_to_another_pool_as_a_dense_computation_does() -> None:
    """Two entries of a reader (GQA, 4 query heads over 2 KV heads) over contexts of an owner's
    pool that cross page boundaries, one of them empty: the joint softmax over (read context,
    own causal context) and the read-only attention equal dense ones."""
    g = torch.Generator().manual_seed(0)
    owner = KVCacheEngine(_Probe(_spec("owner")), 8, 4, torch.float32, "cpu")
    reader = KVCacheEngine(_Probe(_spec("reader")), 8, 4, torch.float32, "cpu")
    link_peers([owner, reader])
    obm, rbm = BlockManager(8, 4), BlockManager(8, 4)
    ctx = {"a": torch.randn(2, 6, 2, 8, 2, generator=g), "b": None}  # layer, token, head, dim, k|v
    reads = []
    for rid, c in ctx.items():
        if c is not None:
            slots = obm.append((rid, "main"), 6)
            for layer in range(2):
                owner.pool.write(layer, c[layer, ..., 0], c[layer, ..., 1], slots)
            reads.append(ReadSlots("owner", "main", 6, obm.page_table((rid, "main"))))
        else:
            reads.append(ReadSlots("owner", "main", 0, []))
    entries, expect = [], []
    for (rid, c), read, n in zip(ctx.items(), reads, (3, 2)):
        q, k, v = (torch.randn(n, h, 8, generator=g) for h in (4, 2, 2))
        slots = rbm.append((rid, "main"), n)
        kv = KVSlots(0, n, slots, rbm.page_table((rid, "main")), reads=(read,))
        entries.append(StepEntry(rid, "main", {"q": q, "k": k, "v": v}, kv))
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        if c is None:
            expect.append((attention(q, k, v, causal), torch.zeros(n, 4, 8)))
            continue
        ck, cv = c[1, ..., 0], c[1, ..., 1]
        mask = torch.cat([torch.ones(n, 6, dtype=torch.bool), causal], dim=1)
        expect.append((attention(q, torch.cat([ck, k]), torch.cat([cv, v]), mask), attention(q, ck, cv)))
    out = reader.run("look", entries)
    for got, (joint, cross) in zip(out, expect):
        torch.testing.assert_close(got["joint"], joint, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["cross"], cross, atol=1e-5, rtol=1e-5)
    with pytest.raises(Exception, match="has no KV pool on this worker"):
        KVCacheEngine(_Probe(_spec("lonely")), 8, 4, torch.float32, "cpu").run("look", entries[:1])


def test_read_only_attention_of_equal_entries_is_batched_and_dense() -> None:
    """Entries with one query count whose read contexts have one length (a decoder's
    cross-attention over its encoder's frames) take the batched path (`_read_rows`: one gather
    and one attention for all of them); it equals the dense computation, GQA included."""
    g = torch.Generator().manual_seed(1)
    owner = KVCacheEngine(_Probe(_spec("owner")), 16, 4, torch.float32, "cpu")
    reader = KVCacheEngine(_Probe(_spec("reader")), 16, 4, torch.float32, "cpu")
    link_peers([owner, reader])
    obm, rbm = BlockManager(16, 4), BlockManager(16, 4)
    entries, expect = [], []
    for rid in ("a", "b", "c"):
        c = torch.randn(2, 7, 2, 8, 2, generator=g)  # 7 tokens: two pages, the second partly full
        slots = obm.append((rid, "main"), 7)
        for layer in range(2):
            owner.pool.write(layer, c[layer, ..., 0], c[layer, ..., 1], slots)
        read = ReadSlots("owner", "main", 7, obm.page_table((rid, "main")))
        q, k, v = (torch.randn(2, h, 8, generator=g) for h in (4, 2, 2))
        kv = KVSlots(0, 2, rbm.append((rid, "main"), 2), rbm.page_table((rid, "main")), reads=(read,))
        entries.append(StepEntry(rid, "main", {"q": q, "k": k, "v": v}, kv))
        expect.append(attention(q, c[1, ..., 0], c[1, ..., 1]))
    served: list[bool] = []
    batched = reader._read_rows

    def spy(*args: object) -> torch.Tensor | None:
        got = batched(*args)  # type: ignore[arg-type]
        served.append(got is not None)
        return got

    reader._read_rows = spy  # type: ignore[method-assign]
    out = reader.run("look", entries)
    assert served and all(served)  # the batched path, not the loop, served the read-only attention
    for got, cross in zip(out, expect):
        torch.testing.assert_close(got["cross"], cross, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- VLA: reads another node's context
def test_vla_actions_equal_a_dense_computation(vla: MStar) -> None:
    """Three requests (prompts of 5, 9 and 17 tokens) batched: each denoise step's action
    tokens attend to that request's VLM prefix."""
    prompts = [torch.arange(3, 3 + n, dtype=torch.int32) * 7 % 512 for n in (5, 9, 17)]
    handles = [vla.submit("act", {"prompt": p, "seed": i}) for i, p in enumerate(prompts)]
    for i, (h, p) in enumerate(zip(handles, prompts)):
        torch.testing.assert_close(h.result(timeout=60)["actions"], act_reference(vla, p, i), atol=2e-5, rtol=1e-4)
    # the prefix matters: another prompt gives other actions from the same noise
    other = vla.generate("act", prompt=prompts[0].flip(0), seed=0)["actions"]
    assert (other - handles[0].result()["actions"]).abs().max() > 1e-3


def _pool_use(conductor: Conductor) -> dict[tuple[str, str], int]:
    """Pages each (node, tag) context of any request holds now."""
    use: dict[tuple[str, str], int] = {}
    for (n, _), bm in conductor.kv.managers.items():
        for req in conductor.running:
            for tag in bm.tags(req.id):
                key = (n, tag)
                use[key] = max(use.get(key, 0), len(bm.page_table((req.id, tag))))
    return use


def test_pools_hold_what_the_memory_pass_sized(plans: dict[str, Path]) -> None:
    """Reading copies nothing: the expert's context never holds more than one action chunk, the
    VLM's its prefix, the decoder's @text at most max_seq_len (+1 speculative) tokens and @cross
    at most its max_len; the pools are the plan's sizes."""
    peaks: dict[tuple[str, str], int] = {}
    for name, walk, inputs in (("vla", "act", {"prompt": torch.arange(40, dtype=torch.int32), "seed": 3}),
                               ("asr", "transcribe", {"audio": audio(2000)})):
        plan = load_plan(plans[name])
        worker = Worker(plan, 0, torch.device("cpu"), "dummy")
        c = Conductor(plan, {0: worker})
        req = c.submit(walk, inputs)
        run_step = worker.run_step

        def sampled(batch: Any, c: Conductor = c, run_step: Any = run_step) -> Any:
            for key, n in _pool_use(c).items():  # while the step's pages are reserved
                peaks[key] = max(peaks.get(key, 0), n)
            return run_step(batch)

        worker.run_step = sampled  # type: ignore[method-assign]
        c.run_until_idle()
        assert req.state == "finished", req.error
        for pool in plan.memory[0].kv.values():
            assert worker.engines[pool.node].num_pages == pool.pages
    ps = load_plan(plans["vla"]).page_size
    assert peaks[("expert", "main")] == 1 and peaks[("vlm", "main")] == math.ceil(40 / ps)
    assert peaks[("decoder", "cross")] == math.ceil(2000 / 40 / ps)  # 50 frames of 40 samples
    assert peaks[("decoder", "text")] <= math.ceil((32 + 1) / ps)


# ---------------------------------------------------------------------- ASR: streamed in, two contexts
def test_asr_whole_fed_and_reference_agree(asr: MStar) -> None:
    sound = audio(700, seed=1)  # 4 chunks of 160 samples and a partial one of 60
    reference = transcribe_reference(asr, sound)
    assert reference.shape[0] >= 5  # several tokens per chunk, loops that end early
    whole = asr.generate("transcribe", audio=sound)["text"]
    h = asr.submit("transcribe", {}, streaming=True)
    for start in range(0, 700, 37):  # parts unaligned to the chunks
        h.feed("audio", sound[start : start + 37])
    h.close_input("audio")
    fed = h.result(timeout=60)["text"]
    assert torch.equal(whole, reference) and torch.equal(fed, reference)


def test_input_streams_into_a_running_walk(asr: MStar) -> None:
    """The first chunk's tokens come out before the rest of the audio is fed; meanwhile the
    engine sleeps instead of spinning."""
    sound = audio(480, seed=2)
    h = asr.submit("transcribe", {}, streaming=True)
    h.feed("audio", sound[:160])
    stream = h.stream()
    first = next(stream)
    assert first[0] == "text" and not h.done
    deadline = time.monotonic() + 30
    while not asr.conductor.stalled and time.monotonic() < deadline:  # the first chunk's loop ends
        time.sleep(0.01)
    steps = asr.stats()["steps"]
    time.sleep(0.2)
    assert asr.stats()["steps"] == steps  # stalled on the client: no steps, no busy loop
    h.feed("audio", sound[160:])
    h.close_input("audio")
    rest = [v for _, v in stream]
    text = h.result()["text"]
    assert torch.equal(torch.cat([first[1], *rest]), text)
    assert torch.equal(text, transcribe_reference(asr, sound))


def test_feed_waits_for_room_backpressure(plans: dict[str, Path]) -> None:
    """One request holds the only running slot; a second one's feeds pile up at the engine
    until `capacity` items wait, then `feed` blocks (a timeout says so), and goes on once the
    first request finishes and the second is admitted."""
    capacity = load_plan(plans["asr"]).stream("transcribe:transcribe.audio->encoder.samples").capacity
    with MStar.load(plans["asr"], max_running=1) as m:
        first = m.submit("transcribe", {}, streaming=True)
        first.feed("audio", audio(100))
        second = m.submit("transcribe", {}, streaming=True)
        second.feed("audio", audio(capacity, seed=5))  # one part may be as large as the buffer
        with pytest.raises(TimeoutError, match="was not taken within"):
            second.feed("audio", audio(10), timeout=0.2)
        done = threading.Event()

        def feed_more() -> None:
            second.feed("audio", audio(10, seed=6), timeout=30)
            done.set()

        t = threading.Thread(target=feed_more)
        t.start()
        assert not done.wait(0.2)
        first.close_input("audio")
        first.result(timeout=30)
        assert done.wait(30)
        t.join()
        second.close_input("audio")
        expect = transcribe_reference(m, torch.cat([audio(capacity, seed=5), audio(10, seed=6)]))
        assert torch.equal(second.result(timeout=30)["text"], expect)


def test_a_fed_part_larger_than_the_buffer_goes_in_pieces(plans: dict[str, Path]) -> None:
    plan = load_plan(plans["asr"])
    c = Conductor(plan, {0: Worker(plan, 0, torch.device("cpu"), "dummy")})
    req = c.submit("transcribe", {}, streaming=True)
    sound = audio(2 * 640 + 7, seed=3)  # one part, twice the buffer (33 frames: within @cross)
    c.feed(req.id, "audio", sound)
    c.close_input(req.id, "audio")
    sid = "transcribe:transcribe.audio->encoder.samples"
    pending = []
    c.run_until_idle(lambda: pending.append(req.buffers[sid].pending if sid in req.buffers else 0))
    assert req.state == "finished", req.error
    assert max(pending) <= plan.stream(sid).capacity
    with MStar.load(plans["asr"]) as m:
        assert torch.equal(req.outputs["text"], transcribe_reference(m, sound))


def test_preempted_request_replays_its_fed_input(plans: dict[str, Path]) -> None:
    sound = audio(900, seed=4)
    with MStar.load(plans["asr"], preempt_every=3) as m:
        h = m.submit("transcribe", {}, streaming=True)
        for start in range(0, 900, 250):
            h.feed("audio", sound[start : start + 250])
        h.close_input("audio")
        assert torch.equal(h.result(timeout=60)["text"], transcribe_reference(m, sound))
        assert h.stats["preemptions"] == 1


def test_cancel_timeout_and_bad_feeds(asr: MStar, plans: dict[str, Path]) -> None:
    with pytest.raises(RequestError, match="input 'audio': missing"):
        asr.submit("transcribe", {})
    h = asr.submit("transcribe", {}, streaming=True)
    with pytest.raises(RequestError, match="not a streamed input") as e:
        h.feed("speech", audio(4))
    assert e.value.field == "speech"
    with pytest.raises(RequestError, match="expected f32 values"):
        h.feed("audio", torch.ones(4, dtype=torch.int32))
    with pytest.raises(RequestError, match="expected 1 dimension"):
        h.feed("audio", torch.ones(4, 2))
    h.feed("audio", audio(200))
    h.cancel()
    with pytest.raises(RequestFailed, match="cancelled"):
        h.result(timeout=30)
    with pytest.raises(RequestFailed):
        h.feed("audio", audio(4))
    whole = asr.submit("transcribe", {"audio": audio(100)})
    with pytest.raises(RequestError, match="given whole"):
        whole.feed("audio", audio(4))
    closed = asr.submit("transcribe", {}, streaming=True)
    closed.close_input("audio")
    with pytest.raises(RequestError, match="is closed"):
        closed.feed("audio", audio(4))
    assert closed.result(timeout=30)["text"].shape == (0,)  # no audio, no text
    slow = asr.submit("transcribe", {}, streaming=True, timeout=0.3)
    with pytest.raises(RequestFailed) as failed:
        slow.result(timeout=30)  # the engine wakes for the deadline though nothing comes
    assert failed.value.finish_reason == "timeout"


def test_a_context_past_its_tags_max_len_fails_the_request(asr: MStar) -> None:
    """@cross holds at most max_source = 64 frames: 17 chunks (68 frames) are too many."""
    h = asr.submit("transcribe", {"audio": audio(17 * 160)})
    with pytest.raises(RequestFailed, match=r"decoder@cross would hold 68 tokens, more than the max_len of 64 "
                                            r"of its tag 'cross'"):
        h.result(timeout=60)
    ok = asr.submit("transcribe", {"audio": audio(16 * 160)})  # 64 frames fit
    assert ok.result(timeout=60)["text"].shape[0] == 32


# ---------------------------------------------------------------------- across ranks
def test_reads_travel_to_a_worker_process(plans: dict[str, Path], tmp_path: Path) -> None:
    """The VLM and the expert on rank 1 (a worker process): the read contexts' page tables go
    over the wire with the step, and the actions equal one rank's."""
    from mstar_runtime.worker.startup import shutdown_workers, start_workers

    path = compile_walk("vla", tmp_path / "vla2.plan", "devices: {count: 2, type: cpu, memory_gib: 16}\n"
                        "models: {vla: {nodes: {vlm: 1, expert: 1}}}\n")
    plan = load_plan(path, device="cpu")
    assert plan.node("expert").ranks == (1,)
    prompt = torch.arange(11, dtype=torch.int32)
    workers = start_workers(plan, "dummy", "cpu")
    try:
        c = Conductor(plan, workers)
        req = c.submit("act", {"prompt": prompt, "seed": 2})
        c.run_until_idle()
        assert req.state == "finished", req.error
    finally:
        shutdown_workers(workers)
    with MStar.load(plans["vla"]) as m:
        torch.testing.assert_close(req.outputs["actions"], m.generate("act", prompt=prompt, seed=2)["actions"],
                                   atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- real size
@pytest.mark.parametrize("model", ["vla", "asr"])
def test_nodes_hold_the_real_size_arch_tensors(model: str, tmp_path: Path) -> None:
    """Every tensor the real variant's arch lists (checkpoint name and shape) is a parameter of
    its node, built on the meta device from the plan's own settings."""
    import importlib

    out = tmp_path / f"{model}.plan"
    assert mstarc(["compile", str(ROOT / f"models/{model}/{model}.walk"), "--variant", "real", "-p",
                   str(ROOT / "placements/h200x1.yaml"), "-o", str(out)]) == 0
    body = planfile.read(out)
    for name, info in body["nodes"].items():
        module, _, cls = info["impl"].rpartition(".")
        spec = NodeSpec(name, info["engine"], body["model"]["config"], (info.get("arch") or {}).get("args", {}),
                        info["settings"], torch.bfloat16, torch.device("meta"))
        with torch.device("meta"):
            built = getattr(importlib.import_module(module), cls)(spec)
        params = {n: tuple(p.shape) for n, p in built.named_parameters()}
        for tname, shape, _, _ in (info.get("arch") or {}).get("tensors", []):
            assert params.get(tname) == tuple(shape), (name, tname)
