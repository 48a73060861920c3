"""The test model family: nodes build from a NodeSpec, run through paged KV exactly as the dense
reference computes, its stream windows are the runtime's, and its .walk file checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mstar_models.testfamily import CONTEXT_SUFFIX, TinyCodec, TinyFlow, TinyLM, TinyPrompt
from mstar_models.testfamily import reference as R
from mstar_models.testfamily.family import (
    CONFIGS,
    NODES,
    STREAMS,
    Family,
    build_family,
    node_spec,
    stream_policy,
)
from mstar_runtime.control.streams import StreamBuffer, policy_from_spec
from mstar_runtime.kv.attention import AttentionMetadata, KVPool, paged_attention
from mstar_runtime.kv.block_manager import BlockManager, SeqKey
from mstar_runtime.ops.node import AttentionContext, Batch, NodeError, RequestError, SeqPlan, SeqState
from mstar_runtime.ops.readback import resolve

WALK_FILE = Path(__file__).resolve().parents[1] / "models" / "testfamily" / "testfamily.walk"
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def family() -> Family:
    torch.manual_seed(1234)  # the nodes must not depend on it; they seed their own weights
    return build_family("tiny")


class PagedKV:
    """A minimal KV engine for one TinyLM: BlockManager pages, one KVPool, paged_attention
    over the whole mixed batch, per-(request, tag) state dicts, forks and keep=False."""

    def __init__(self, lm: TinyLM, num_pages: int = 96, page_size: int = 4):
        geo = lm.kv_geometry
        self.lm = lm
        self.pool = KVPool(geo.layers, num_pages, page_size, geo.kv_heads, geo.head_dim)
        self.blocks = BlockManager(num_pages, page_size)
        self.states: dict[SeqKey, dict[str, Any]] = {}

    def step(self, phase: str, batch: Batch, keys: list[SeqKey], resolve_outputs: bool = True) -> Batch:
        plans: list[SeqPlan] = []
        for entry in batch:
            shapes = {port: tuple(v.shape) for port, v in entry.items() if isinstance(v, torch.Tensor)}
            plans.append(TinyLM.kv_plan(phase, shapes, self.lm.spec))
        starts = [self.blocks.seq_len(k) if k in self.blocks else 0 for k in keys]
        slots = [s for k, p in zip(keys, plans) for s in self.blocks.append(k, p.q_len)]
        meta = AttentionMetadata.build(
            [p.q_len for p in plans],
            [s + p.q_len for s, p in zip(starts, plans)],
            [self.blocks.page_table(k) for k in keys],
            [p.mask for p in plans],
        )

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.pool.write(layer, k, v, slots)
            return paged_attention(q, self.pool, layer, meta)

        seqs = [SeqState(s, p.q_len, self.states.setdefault(k, {})) for k, s, p in zip(keys, starts, plans)]
        with torch.no_grad():
            out = self.lm.run(phase, batch, AttentionContext(seqs, attend, torch.device("cpu")))
        for key, start, plan in zip(keys, starts, plans):
            if not plan.keep:
                copy = self.blocks.truncate(key, start)
                if copy is not None:
                    self.pool.copy_slots(copy.src, copy.dst)
        if not resolve_outputs:
            return out
        return [{k: resolve(v) for k, v in o.items()} for o in out]  # `code`/`done` are lazy

    def fork(self, src: SeqKey, dst: SeqKey) -> None:
        copy = self.blocks.fork(src, dst)
        if copy is not None:
            self.pool.copy_slots(copy.src, copy.dst)
        self.states[dst] = dict(self.states[src])

    def rename(self, src: SeqKey, dst: SeqKey) -> None:
        """A transition's `keep node@a as b`."""
        self.fork(src, dst)
        self.blocks.free(src)
        del self.states[src]


def encode(family: Family, *texts: str) -> list[torch.Tensor]:
    return [e["tokens"] for e in family.prompt.run("encode", [{"text": t} for t in texts])]


def assert_step(out: dict[str, Any], ref: R.LMStep) -> None:
    assert out["token"].dtype == torch.int32 and out["token"].tolist() == [ref.token]
    assert out["code"].tolist() == ([] if ref.code is None else [ref.code])
    assert out["done"] is ref.done
    torch.testing.assert_close(out["hidden"], ref.hidden, **TOL)


# ---------------------------------------------------------------------- building


def test_nodes_build_from_node_specs(family: Family) -> None:
    assert isinstance(family.prompt, TinyPrompt) and isinstance(family.codec, TinyCodec)
    assert isinstance(family.flow, TinyFlow) and isinstance(family.lm, TinyLM)
    for name, (cls, engine, _) in NODES.items():
        assert cls.engine == engine == node_spec(name, CONFIGS["tiny"]).engine
    geo = family.lm.kv_geometry
    assert (geo.layers, geo.kv_heads, geo.head_dim) == (2, 2, 8)
    assert all(p.dtype == torch.float32 for p in family.lm.parameters())


def test_weights_are_seeded_not_global() -> None:
    a, b = build_family("tiny"), build_family("tiny")
    torch.manual_seed(99)
    c = build_family("tiny", seed=7)
    for name in ("lm", "codec"):
        sa, sb, sc = (getattr(f, name).state_dict() for f in (a, b, c))
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_lm_parameters_carry_the_llama_arch_names() -> None:
    archs = pytest.importorskip("mstarc.archs", reason="the compiler's arch catalogue is not importable")
    for variant in ("tiny", "real"):
        cfg = CONFIGS[variant]
        lm = build_family(variant).lm
        spec = archs.get_arch("llama")({k: cfg[k] for k in node_spec("lm", cfg).arch_args}, "f32")
        params = {k: tuple(v.shape) for k, v in lm.state_dict().items()}
        assert {t.name: t.shape for t in spec.tensors}.items() <= params.items()
        # what the arch cannot know: the flow glue of denoise
        extra = sorted(set(params) - {t.name for t in spec.tensors})
        assert extra == sorted(f"flow_{p}.{w}" for p in ("in", "time", "out") for w in ("weight", "bias"))


def test_lm_refuses_tensor_parallel() -> None:
    spec = node_spec("lm", CONFIGS["tiny"])
    with pytest.raises(NodeError, match="tp=1"):
        TinyLM(type(spec)(**{**spec.__dict__, "tp_size": 2}))


def test_kv_plan_from_shapes() -> None:
    spec = node_spec("lm", CONFIGS["tiny"])
    assert TinyLM.kv_plan("prefill", {"tokens": (7,)}, spec) == SeqPlan(7)
    assert TinyLM.kv_plan("decode", {"token": (1,)}, spec) == SeqPlan(1)
    assert TinyLM.kv_plan("denoise", {"x": (4, 8), "t": (1,)}, spec) == SeqPlan(4, mask="full", keep=False)
    with pytest.raises(RequestError):
        TinyLM.kv_plan("prefill", {"tokens": (0,)}, spec)


def test_prompt_is_byte_level(family: Family) -> None:
    (ids,) = encode(family, "hé")
    assert ids.dtype == torch.int32 and ids.tolist() == [1, 16 + 104, 16 + 0xC3, 16 + 0xA9]
    with pytest.raises(RequestError):
        family.prompt.run("encode", [{"text": 3}])


# ---------------------------------------------------------------------- paged == dense


def test_batched_prefill_and_decodes_match_dense(family: Family) -> None:
    lm, paged = family.lm, PagedKV(family.lm)
    prompts = ["hello world", "a", "The quick brown fox jumps"]
    keys = [(f"r{i}", "main") for i in range(len(prompts))]
    ids = encode(family, *prompts)
    dense = [R.DenseKV(lm.layers) for _ in prompts]
    outs = paged.step("prefill", [{"tokens": t, "max_new": 9} for t in ids], keys)
    refs = [R.ref_prefill(lm, kv, t, 9) for kv, t in zip(dense, ids)]
    for step in range(9):
        for out, ref in zip(outs, refs):
            assert_step(out, ref)
        assert [o["done"] for o in outs] == [step == 8] * 3  # the 9th token reaches max_new
        if step == 8:
            break
        outs = paged.step("decode", [{"token": o["token"]} for o in outs], keys)
        refs = [R.ref_decode(lm, kv, r.token) for kv, r in zip(dense, refs)]
    for key, kv in zip(keys, dense):
        assert paged.blocks.seq_len(key) == kv.length


def test_mixed_lengths_in_one_decode_batch(family: Family) -> None:
    """Requests at different depths share a decode batch; one joins late with its prefill."""
    lm, paged = family.lm, PagedKV(family.lm)
    (a, b) = encode(family, "first request", "second")
    kv_a, kv_b = R.DenseKV(lm.layers), R.DenseKV(lm.layers)
    (out_a,) = paged.step("prefill", [{"tokens": a, "max_new": 20}], [("a", "main")])
    ref_a = R.ref_prefill(lm, kv_a, a, 20)
    for _ in range(3):
        (out_a,) = paged.step("decode", [{"token": out_a["token"]}], [("a", "main")])
        ref_a = R.ref_decode(lm, kv_a, ref_a.token)
    (out_b,) = paged.step("prefill", [{"tokens": b, "max_new": 20}], [("b", "main")])
    ref_b = R.ref_prefill(lm, kv_b, b, 20)
    for _ in range(4):
        out_a, out_b = paged.step(
            "decode", [{"token": out_a["token"]}, {"token": out_b["token"]}], [("a", "main"), ("b", "main")]
        )
        ref_a, ref_b = R.ref_decode(lm, kv_a, ref_a.token), R.ref_decode(lm, kv_b, ref_b.token)
        assert_step(out_a, ref_a)
        assert_step(out_b, ref_b)


def test_denoise_on_two_tags_matches_dense_and_keeps_nothing(family: Family) -> None:
    lm, paged = family.lm, PagedKV(family.lm)
    neg, pos = encode(family, "blurry", "a red cube")
    uncond, cond = ("r", "uncond"), ("r", "cond")
    paged.step("prefill", [{"tokens": neg, "max_new": 1}], [uncond])
    paged.fork(uncond, cond)  # 7 tokens on pages of 4: shares one page, copies a partial one
    paged.step("prefill", [{"tokens": pos, "max_new": 1}], [cond])
    kv_u = R.DenseKV(lm.layers)
    R.ref_prefill(lm, kv_u, neg, 1)
    kv_c = kv_u.fork()
    R.ref_prefill(lm, kv_c, pos, 1)
    lens = (paged.blocks.seq_len(cond), paged.blocks.seq_len(uncond))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    for t in (1.0, 0.5):
        tt = torch.tensor([t])
        v_c, v_u = paged.step("denoise", [{"x": x, "t": tt}, {"x": x, "t": tt}], [cond, uncond])
        torch.testing.assert_close(v_c["v"], R.ref_denoise(lm, kv_c, x, tt), **TOL)
        torch.testing.assert_close(v_u["v"], R.ref_denoise(lm, kv_u, x, tt), **TOL)
        assert not torch.allclose(v_c["v"], v_u["v"], atol=1e-3)  # different contexts matter
        assert (paged.blocks.seq_len(cond), paged.blocks.seq_len(uncond)) == lens
    assert (kv_c.length, kv_u.length) == lens
    # nothing of the denoise blocks stayed behind: a decode still sees the prefilled context
    (out,) = paged.step("decode", [{"token": torch.tensor([40], dtype=torch.int32)}], [cond])
    assert_step(out, R.ref_decode(lm, kv_c, 40))


def test_flow_walk_by_hand_matches_reference(family: Family) -> None:
    """The flow walk driven step by step through the nodes (the Parallel as one batched
    call) gives the reference's latent and trajectory."""
    paged, steps, scale, seed = PagedKV(family.lm), 3, 2.5, 11
    ids, neg = encode(family, "a cat", "")
    (init,) = family.flow.run("init", [{"seed": seed}])
    x = init["x"]
    paged.step("prefill", [{"tokens": neg, "max_new": 1}], [("r", "uncond")])
    paged.fork(("r", "uncond"), ("r", "cond"))
    paged.step("prefill", [{"tokens": ids, "max_new": 1}], [("r", "cond")])
    trajectory = []
    for i in range(steps):
        (time,) = family.flow.run("time", [{"index": i, "steps": steps}])
        v_c, v_u = paged.step("denoise", [{"x": x, "t": time["t"]}] * 2, [("r", "cond"), ("r", "uncond")])
        (nxt,) = family.flow.run(
            "step", [{"x": x, "v_cond": v_c["v"], "v_uncond": v_u["v"], "dt": time["dt"], "scale": scale}]
        )
        x = nxt["x"]
        trajectory.append(x)
    ref = R.run_request(family, "flow", {"prompt": "a cat", "steps": steps, "scale": scale, "seed": seed})
    assert ref[0][0] == "flow"
    torch.testing.assert_close(x, ref[0][1]["latent"], **TOL)
    torch.testing.assert_close(torch.cat(trajectory), ref[0][1]["trajectory"], **TOL)


def test_chat_transition_continue_matches_reference(family: Family) -> None:
    paged = PagedKV(family.lm)
    tokens: dict[str, list[int]] = {}
    for walk, text, tag in (("chat", "hi there", "main"), ("continue", " ok", "cont")):
        (ids,) = encode(family, text)
        (out,) = paged.step("prefill", [{"tokens": ids, "max_new": 8}], [("r", tag)])
        tokens[walk] = [*out["token"].tolist()]
        for _ in range(int(family.config["max_new_tokens"])):
            (out,) = paged.step("decode", [{"token": out["token"]}], [("r", tag)])
            tokens[walk] += out["token"].tolist()
            if out["done"]:
                break
        if walk == "chat":
            assert out["done"]  # handoff
            paged.rename(("r", "main"), ("r", "cont"))
    ref = R.run_request(family, "chat", {"prompt": "hi there"})
    assert [w for w, _ in ref] == ["chat", "continue"] and ref[0][1]["handoff"] is True
    assert ref[0][1]["tokens"].tolist() == tokens["chat"]
    assert ref[1][1]["tokens"].tolist() == tokens["continue"]


def test_done_on_eos_pushes_no_item_and_on_max_context() -> None:
    base = build_family("tiny")
    probe = R.run_request(base, "generate", {"prompt": "stop", "max_new": 12})[0][1]["tokens"].tolist()
    eos = probe[3]  # make the 4th generated token the eos of an otherwise identical model
    fam = build_family("tiny", overrides={"eos": eos})
    out = R.run_generate(fam, "generate", "stop", 12)
    assert out["tokens"].tolist() == probe[: probe.index(eos) + 1]
    assert out["codes"].numel() == out["tokens"].numel() - 1  # eos is no stream item
    paged = PagedKV(fam.lm)
    (ids,) = encode(fam, "stop")
    (step,) = paged.step("prefill", [{"tokens": ids, "max_new": 12}], [("r", "main")])
    while not step["done"]:
        (step,) = paged.step("decode", [{"token": step["token"]}], [("r", "main")])
    assert step["token"].tolist() == [eos] and step["code"].shape == (0,)
    # the context limit: a prompt that fills max_context - 1 tokens is done after one decode
    small = build_family("tiny", overrides={"max_context": 8})
    paged = PagedKV(small.lm)
    (ids,) = encode(small, "abcdef")  # 7 tokens with bos
    (step,) = paged.step("prefill", [{"tokens": ids, "max_new": 50}], [("r", "main")])
    assert step["done"] is False or step["token"].tolist() == [small.lm.eos]
    (step,) = paged.step("decode", [{"token": step["token"]}], [("r", "main")])
    assert step["done"] is True
    with pytest.raises(RequestError, match="max_context"):
        paged.step("prefill", [{"tokens": encode(small, "abcdefgh")[0], "max_new": 1}], [("s", "main")])


# ---------------------------------------------------------------------- streams and codec


POLICIES = {
    "fixed": {"size": 5},
    "sliding": {"window": 8, "stride": 4},
    "left_context": {"chunk": 4, "left": 3},
    "left_context_wide": {"chunk": 2, "left": 5},
    "sliding_tight": {"window": 3, "stride": 3},
}


def buffer_windows(kind: str, params: dict[str, int], pushes: list[int]) -> list[R.Window]:
    buf = StreamBuffer(policy_from_spec({"kind": kind, **params}), capacity=1000)
    chunks = []
    for n in pushes:
        buf.push(torch.zeros(n, dtype=torch.int32))
        chunks += buf.pop_ready()
    buf.close()
    chunks += buf.pop_ready()
    return [R.Window(c.start, c.start + c.items.shape[0], c.context) for c in chunks]


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 7, 8, 9, 12, 13, 16, 23])
def test_reference_windows_are_the_stream_buffers(name: str, n: int) -> None:
    kind = name.removesuffix("_wide").removesuffix("_tight")
    params = POLICIES[name]
    expect = R.chunk_windows(kind, params, n)
    assert buffer_windows(kind, params, [1] * n) == expect
    ragged = [0, 2, 1, 0, 5, 3, 1, 7, 4, 2, 9]  # pushes of 0 items are what eos does
    pattern, total = [], 0
    for p in ragged:
        p = min(p, n - total)
        pattern.append(p)
        total += p
    pattern.append(n - total)
    assert buffer_windows(kind, params, pattern) == expect


@pytest.mark.parametrize("walk", list(STREAMS))
def test_codec_over_stream_buffer_matches_reference_audio(family: Family, walk: str) -> None:
    """A generate walk's code stream pushed step by step (0 or 1 items), chunks decoded in one
    batched codec call with their context counts: the reference's audio, chunk for chunk."""
    ref = R.run_generate(family, walk, "stream me", 23)
    kind, params = stream_policy(walk, family.config)
    phase, port = STREAMS[walk][2], {"sliding": "window", "fixed": "block", "left_context": "frames"}[kind]
    buf = StreamBuffer(policy_from_spec({"kind": kind, **params}), capacity=64)
    chunks = []
    for code in ref["codes"]:
        buf.push(code.reshape(1))
        chunks += buf.pop_ready()
    buf.close()
    chunks += buf.pop_ready()
    assert [R.Window(c.start, c.start + len(c.items), c.context) for c in chunks] == ref["windows"]
    assert len(chunks) >= 3
    with torch.no_grad():
        outs = family.codec.run(phase, [{port: c.items, port + CONTEXT_SUFFIX: c.context} for c in chunks])
    pcm = torch.cat([o["pcm"] for o in outs])
    new_items = sum(len(c.items) - c.context for c in chunks)
    assert pcm.shape == (new_items * int(family.config["hop"]),)
    torch.testing.assert_close(pcm, ref["audio"], **TOL)


def test_codec_context_changes_only_what_it_should(family: Family) -> None:
    codes = torch.tensor([3, 9, 27, 1, 5, 60], dtype=torch.int32)
    hop = int(family.config["hop"])
    with torch.no_grad():
        full, tail = family.codec.run(
            "decode_frames", [{"frames": codes, "frames:context": 0}, {"frames": codes, "frames:context": 2}]
        )
        (alone,) = family.codec.run("decode_frames", [{"frames": codes[2:], "frames:context": 0}])
    torch.testing.assert_close(tail["pcm"], full["pcm"][2 * hop :], **TOL)  # same items, same samples
    assert not torch.allclose(alone["pcm"][:hop], tail["pcm"][:hop])  # the context shaped them
    with pytest.raises(NodeError, match="frames:context"):
        family.codec.run("decode_frames", [{"frames": codes}])


# ---------------------------------------------------------------------- the .walk file


def _lowered(variant: str):
    pytest.importorskip("lark", reason="the compiler's parser needs lark")
    from mstarc.lower import lower
    from mstarc.parser import parse_file

    return lower(parse_file(str(WALK_FILE), "testfamily.walk"), variant, "testfamily.walk")


@pytest.mark.parametrize("variant", ["tiny", "real"])
def test_walk_file_checks(variant: str, capsys: pytest.CaptureFixture[str]) -> None:
    from mstarc.cli import main

    assert main(["check", str(WALK_FILE), "--variant", variant]) == 0, capsys.readouterr().err
    assert "error" not in capsys.readouterr().err


@pytest.mark.parametrize("variant", ["tiny", "real"])
def test_python_configs_mirror_the_walk_file(variant: str) -> None:
    model = _lowered(variant)
    assert dict(model.config) == CONFIGS[variant]
    assert {name: node.impl for name, node in model.nodes.items()} == {
        name: f"mstar_models.testfamily.{cls.__name__}" for name, (cls, _, _) in NODES.items()
    }
    assert {name: node.engine for name, node in model.nodes.items()} == {
        n: e for n, (_, e, _) in NODES.items()
    }
    assert dict(model.nodes["lm"].arch_args) == dict(node_spec("lm", CONFIGS[variant]).arch_args)
    streams = {e.dst_port: (e.policy.kind, e.policy.params) for e in model.edges if e.policy is not None}
    for walk in STREAMS:
        kind, params = stream_policy(walk, CONFIGS[variant])
        assert (kind, params) in streams.values()


def test_walks_use_every_primitive() -> None:
    from mstarc import ir as I

    model = _lowered("tiny")
    regions = [r for w in model.walks.values() for r in I.iter_regions(w.body)]
    loops = [r for r in regions if isinstance(r, I.Loop)]
    assert any(lp.dynamic for lp in loops) and any(not lp.dynamic and lp.index and lp.carry for lp in loops)
    assert any(isinstance(r, I.Acc) for r in regions) and any(isinstance(r, I.Fork) for r in regions)
    tagged = {
        c.tag
        for r in regions
        if isinstance(r, I.Parallel)
        for b in r.branches
        for c in I.iter_regions(b.body)
        if isinstance(c, I.Call)
    }
    assert {"cond", "uncond", None} <= tagged  # CFG over KV tags, and stateless branches
    assert {e.policy.kind for e in model.edges if e.policy} == {"fixed", "sliding", "left_context"}
    assert {r.stream for r in regions if isinstance(r, I.OnStream)} == {e.id for e in model.edges if e.policy}
    (t,) = model.transitions
    assert (t.src, t.dst, t.when) == ("chat", "continue", "handoff")
    assert set(model.walks) == {*STREAMS, "flow", "chat", "continue"}
