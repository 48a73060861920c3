"""BAGEL's MoTLanguageModel: parity with HF Qwen3 (each expert) and with the re-derived reference.

CPU, float32, the tiny variant's sizes (models/bagel/bagel.walk `variant tiny`), every phase
run through the runtime's paged `KVCacheEngine` with slots from a `BlockManager`, as the
conductor would reserve them (keep=False queries truncated after their step).

References:
- transformers 5.24 `Qwen3ForCausalLM(Qwen3Config(..., attention_bias=True, head_dim=16))`
  is Qwen2 with per-head QK-norm before RoPE: the und expert on a text-only sequence
  (o_proj bias zero), and, with the `*_moe_gen` weights copied in, the gen expert on an
  all-gen sequence (docs/models/bagel.md, Facts).
- `mstar_models.bagel.reference` for what no HF class has: mixed und/gen blocks at one RoPE
  position, non-causal blocks, the latent embedding and the denoise velocity, several tags.

Tolerances (float32): both sides run the same operations in the same dtype; only summation
orders differ (paged attention, batched GEMMs), ~1e-6 measured. Logits are compared with
rtol 1e-5 and an atol of 1e-5 x their largest magnitude, velocities likewise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mstar_models.bagel import mot
from mstar_models.bagel.mot import MoTLanguageModel, Route, sincos_2d, timestep_features
from mstar_models.bagel.reference import ReferenceConfig, ReferenceContext, sincos_table, timestep_embedding
from mstar_runtime.engine.cohort_engine import CohortColumns, CohortShape
from mstar_runtime.engine.engines import KVCacheEngine, KVSlots, StepEntry
from mstar_runtime.kv.attention import paged_attention
from mstar_runtime.kv.block_manager import BlockManager
from mstar_runtime.ops.node import NodeError, NodeSpec, RequestError
from mstar_runtime.ops.readback import Lazy, resolve
from mstar_runtime.sampling import sample, sample_columns

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
CONFIG: dict[str, Any] = {
    "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 128, "vocab": 300,
    "rope_theta": 1e6, "rms_eps": 1e-6, "latent_patch_size": 2, "max_latent_size": 4, "patch_dim": 16,
    "timestep_dim": 256, "max_text_tokens": 64, "bos_id": 296, "eos_id": 297, "vision_start_id": 298,
    "vision_end_id": 299,
}
ARCH = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "patch_dim",
        "max_latent_size", "timestep_dim")
BOS, EOS, VS, VE = 296, 297, 298, 299
PAGE, PAGES = 8, 96
REPLY = ("token", "emitted", "done", "image_start")
PORTS = {"prefill_text": (), "prefill_vit": (), "prefill_vae": (), "start": REPLY, "decode": REPLY,
         "denoise": ("velocity",)}


# ------------------------------------------------------------------------------ fixtures
def make_spec(config: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", **settings: Any) -> NodeSpec:
    cfg = {**CONFIG, **(config or {})}
    return NodeSpec("llm", "kv", cfg, {k: cfg[k] for k in ARCH}, settings, dtype, torch.device(device))


def randomize_(node: MoTLanguageModel, seed: int = 0) -> MoTLanguageModel:
    """Weights that make every part matter: embeddings N(0, 0.25^2), matrices N(0, 1/fan_in),
    biases N(0, 0.1^2), norm gains 1 + N(0, 0.1^2), the latent table N(0, 0.5^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in node.named_parameters():
            if "embed_tokens" in name:
                values = 0.25 * torch.randn(p.shape, generator=gen)
            elif name == "latent_pos_embed.pos_embed":
                values = 0.5 * torch.randn(p.shape, generator=gen)
            elif p.dim() == 2:
                values = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
            elif name.endswith(".bias"):
                values = 0.1 * torch.randn(p.shape, generator=gen)
            else:
                values = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(values)
    return node.eval().requires_grad_(False)


def build(config: dict[str, Any] | None = None, weights: MoTLanguageModel | None = None,
          dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", **settings: Any) -> MoTLanguageModel:
    node = MoTLanguageModel(make_spec(config, dtype, device, **settings))
    if weights is None:
        return randomize_(node)
    node.load_state_dict(weights.state_dict(), strict=True)
    return node.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def node() -> MoTLanguageModel:
    return build()


def reference(node: MoTLanguageModel) -> ReferenceContext:
    c = node.spec.config
    cfg = ReferenceConfig(layers=c["layers"], heads=c["heads"], kv_heads=c["kv_heads"], head_dim=c["head_dim"],
                          max_latent_size=c["max_latent_size"], bos_id=BOS, eos_id=EOS, vision_start_id=VS,
                          vision_end_id=VE)
    return ReferenceContext({k: v.detach().float().cpu().clone() for k, v in node.state_dict().items()}, cfg)


class Runner:
    """A node on a KVCacheEngine with a BlockManager reserving slots as the conductor does.
    Outputs come back resolved, as the interpreter reads them (`readback.Lazy` values: the
    column step's `decode`, and `start` on a GPU); `lazy=True` returns them as the node gives them."""

    def __init__(self, node: MoTLanguageModel, backend: Callable[..., torch.Tensor] | None = None,
                 ports: dict[str, tuple[str, ...]] | None = PORTS, graphs: dict[str, list[int]] | None = None,
                 lazy: bool = False):
        self.node, self.lazy = node, lazy
        self.engine = KVCacheEngine(node, PAGES, PAGE, node.spec.dtype, node.spec.device, output_ports=ports,
                                    attention_backend=backend, graphs=graphs)
        self.bm = BlockManager(PAGES, PAGE)

    def run(self, phase: str, items: list[tuple[str, str, dict[str, Any]]]) -> list[dict[str, Any]]:
        entries, truncate = [], []
        for rid, tag, inputs in items:
            shapes = {k: tuple(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
            plan = MoTLanguageModel.kv_plan(phase, shapes, self.node.spec)
            key = (rid, tag)
            start = self.bm.seq_len(key) if key in self.bm else 0
            slots = self.bm.append(key, plan.q_len)
            entries.append(StepEntry(rid, tag, inputs, KVSlots(start, plan.q_len, slots, self.bm.page_table(key),
                                                               plan.mask, plan.block_size, plan.keep)))
            if not plan.keep:
                truncate.append((key, start))
        try:
            outs = self.engine.run(phase, entries)
            return outs if self.lazy else [{k: resolve(v) for k, v in out.items()} for out in outs]
        finally:
            for key, start in truncate:
                copy = self.bm.truncate(key, start)
                if copy is not None:
                    self.engine.copy_slots(copy)

    def one(self, phase: str, rid: str, tag: str, **inputs: Any) -> dict[str, Any]:
        return self.run(phase, [(rid, tag, inputs)])[0]

    def fork(self, rid: str, src: str, dst: str) -> None:
        if (rid, src) in self.bm:  # an empty source forks into an empty context
            copy = self.bm.fork((rid, src), (rid, dst))
            if copy is not None:
                self.engine.copy_slots(copy)
        self.engine.fork_state(rid, src, dst)


class Logits:
    """Wraps `node.head`: records every logits row; `force[k]` makes call k pick that token."""

    def __init__(self, node: MoTLanguageModel, force: dict[int, int] | None = None):
        self.head, self.rows, self.force, self.calls = node.head, [], force or {}, 0

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        token = self.force.get(self.calls)
        if token is not None:
            logits = logits.clone()
            logits[:, token] = 1e4
        self.calls += 1
        self.rows.append(logits)
        return logits


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> bool:
    return torch.allclose(a, b, rtol=rtol, atol=rtol * float(b.abs().max()))


def text(seed: int, n: int) -> torch.Tensor:
    """n ordinary token ids (below the four specials)."""
    return torch.randint(0, BOS, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def qwen3(node: MoTLanguageModel, expert: str) -> Any:
    """HF Qwen3 holding one expert's weights ('' und, '_moe_gen' gen); o_proj bias zero."""
    c = CONFIG
    cfg = transformers.Qwen3Config(
        vocab_size=c["vocab"], hidden_size=c["hidden"], num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"],
        intermediate_size=c["intermediate"], rms_norm_eps=c["rms_eps"], attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]}, tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    ours = node.state_dict()
    state = {}
    for name in hf.state_dict():
        if name == "lm_head.weight":
            src = "language_model.lm_head.weight"
        elif name.endswith("o_proj.bias"):
            state[name] = torch.zeros(c["hidden"])
            continue
        else:
            src = "language_model." + name
            if expert and ".layers." in name:
                for stem in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "input_layernorm",
                             "post_attention_layernorm", "mlp"):
                    src = src.replace(f".{stem}.", f".{stem}{expert}.")
            elif expert and name == "model.norm.weight":
                src = "language_model.model.norm_moe_gen.weight"
        state[name] = ours[src]
    hf.load_state_dict(state, strict=True)
    return hf


# ------------------------------------------------------------------- (a), (b): HF Qwen3
def test_und_path_equals_hf_qwen3_on_text(node: MoTLanguageModel, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = qwen3(node, "")
    prompt = text(1, 9)
    rec = Logits(node)
    monkeypatch.setattr(node, "head", rec)
    r = Runner(node)
    r.one("prefill_text", "r", "gen", text=prompt)
    out = r.one("start", "r", "gen", temperature=0.0, max_length=50)
    tokens = [int(out["token"])]
    for _ in range(7):
        assert out["done"] is False and out["image_start"] is False
        assert out["emitted"].device.type == "cpu" and out["emitted"].tolist() == out["token"].tolist()
        out = r.one("decode", "r", "gen", token=out["token"])
        tokens.append(int(out["token"]))
    # HF over the same tokens: the prompt, <|im_start|>, then the generated ones
    ids = torch.tensor([*prompt.tolist(), BOS, *tokens[:-1]])
    with torch.no_grad():
        want = hf(ids[None]).logits[0, len(prompt):]
    got = torch.cat(rec.rows)
    assert got.shape == want.shape == (8, CONFIG["vocab"])
    assert close(got, want), f"max abs diff {float((got - want).abs().max()):.2e}"
    assert tokens == want.argmax(-1).tolist()  # greedy, and HF's greedy from the same prefix


def test_gen_expert_equals_hf_qwen3_on_an_all_gen_sequence(node: MoTLanguageModel,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """No phase runs text through the gen expert, so this drives `forward` directly with every
    row routed to gen (a causal sequence through the engine)."""
    hf = qwen3(node, "_moe_gen")

    def phase_allgen(batch: list[dict[str, Any]], attn: Any) -> list[dict[str, Any]]:
        ids = torch.cat([e["text"] for e in batch]).long()
        h = node.language_model.model.embed_tokens(ids)
        pos, n = attn.positions(), h.shape[0]
        route = Route(torch.zeros(0, dtype=torch.long), torch.arange(n), torch.arange(n))
        _, g = node.forward(h[:0], pos[:0], h, pos, route, attn.attend)
        return [{"logits": node.head(g)}]

    monkeypatch.setattr(node, "phase_allgen", phase_allgen, raising=False)
    r = Runner(node, ports=None)
    ids = text(2, 11)
    slots = r.bm.append(("r", "gen"), 11)
    got = r.engine.run("allgen", [StepEntry("r", "gen", {"text": ids},
                                            KVSlots(0, 11, slots, r.bm.page_table(("r", "gen"))))])[0]["logits"]
    with torch.no_grad():
        want = hf(ids.long()[None]).logits[0]
    assert close(got, want), f"max abs diff {float((got - want).abs().max()):.2e}"
    # and the und weights give something else: the two experts really are separate
    assert not close(got, qwen3(node, "")(ids.long()[None]).logits[0].detach())


# ---------------------------------------------------------------- (c): mixed sequences
def test_mixed_context_denoise_and_decode_equal_the_reference(node: MoTLanguageModel,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Logits(node)
    monkeypatch.setattr(node, "head", rec)
    r, ref = Runner(node), reference(node)
    t1, vit, clean, t2 = text(3, 5), randn(4, 6, 64), randn(5, 6, 16), text(6, 4)
    r.one("prefill_text", "r", "gen", text=t1)
    ref.text(t1)
    r.one("prefill_vit", "r", "gen", vit=vit)
    ref.vit(vit)
    r.one("prefill_vae", "r", "gen", clean=clean, height=32, width=48)  # 2 x 3 latents
    ref.vae(clean, 32, 48)
    r.one("prefill_text", "r", "gen", text=t2)
    ref.text(t2)
    # every image block took one RoPE position: 5 + 1 + 1 + 4 positions over 5 + 8 + 8 + 4 KV tokens
    assert r.engine.state("r", "gen") == {"rope_offset": 11 - 25} and ref.rope == 11 and ref.kv_len == 25

    for seed, t, (height, width) in ((7, 0.9, (64, 64)), (8, 0.3, (48, 32)), (9, 0.0, (16, 64))):
        latent = randn(seed, (height // 16) * (width // 16), 16)
        got = r.one("denoise", "r", "gen", latent=latent, t=t, height=height, width=width)["velocity"]
        want = ref.velocity(latent, t, height, width)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert close(got, want), f"t={t}: max abs diff {float((got - want).abs().max()):.2e}"
    assert r.bm.seq_len(("r", "gen")) == 25  # denoise queries are not kept

    out = r.one("start", "r", "gen", temperature=0.0, max_length=50)
    want_logits = [ref.step(BOS)]
    for _ in range(3):
        want_logits.append(ref.step(int(out["token"])))
        out = r.one("decode", "r", "gen", token=out["token"])
    assert close(torch.cat(rec.rows), torch.stack(want_logits))


def test_blocks_are_non_causal_and_at_one_position(node: MoTLanguageModel) -> None:
    """With the latent table constant, a block's rows differ only by content: one RoPE
    position and a full mask make the velocity permutation-equivariant (distinct positions
    or a causal mask would not), and the first row sees the last."""
    flat = build(weights=node)
    with torch.no_grad():
        flat.latent_pos_embed.pos_embed.copy_(randn(10, 64).expand(16, 64))
    r = Runner(flat)
    r.one("prefill_text", "r", "gen", text=text(11, 6))
    latent = randn(12, 16, 16)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(13))

    def velocity(x: torch.Tensor) -> torch.Tensor:
        return r.one("denoise", "r", "gen", latent=x, t=0.5, height=64, width=64)["velocity"]

    v = velocity(latent)
    assert close(velocity(latent[perm]), v[perm])
    changed = latent.clone()
    changed[-1] += 1.0
    assert not close(velocity(changed)[0], v[0])  # row 0 attends to row 15


# ------------------------------------------------------------------ (d): batch and tags
def test_one_denoise_call_over_requests_and_cfg_tags_equals_each_alone(node: MoTLanguageModel) -> None:
    r = Runner(node)
    refs: dict[tuple[str, str], ReferenceContext] = {}
    # edit: gen = [VAE image, ViT image, prompt], cfg_text = the images, cfg_img = the prompt
    clean, vit, prompt = randn(20, 4, 16), randn(21, 5, 64), text(22, 7)
    r.one("prefill_vae", "e", "gen", clean=clean, height=32, width=32)
    r.one("prefill_vit", "e", "gen", vit=vit)
    r.fork("e", "gen", "cfg_text")
    r.one("prefill_text", "e", "gen", text=prompt)
    r.one("prefill_text", "e", "cfg_img", text=prompt)
    ref = reference(node)
    ref.vae(clean, 32, 32)
    ref.vit(vit)
    refs["e", "cfg_text"] = ref.copy()
    ref.text(prompt)
    refs["e", "gen"] = ref
    refs["e", "cfg_img"] = reference(node)
    refs["e", "cfg_img"].text(prompt)
    # t2i: cfg_text = the empty context (forked before the prompt), cfg_img = gen
    r.fork("t", "gen", "cfg_text")
    t2i = text(23, 9)
    r.one("prefill_text", "t", "gen", text=t2i)
    r.fork("t", "gen", "cfg_img")
    refs["t", "cfg_text"] = reference(node)
    refs["t", "gen"] = reference(node)
    refs["t", "gen"].text(t2i)
    refs["t", "cfg_img"] = refs["t", "gen"].copy()

    x = {"e": randn(24, 4, 16), "t": randn(25, 12, 16)}
    size = {"e": (32, 32), "t": (48, 64)}
    times = {"e": 0.8, "t": 0.45}
    items = [(rid, tag, {"latent": x[rid], "t": times[rid], "height": size[rid][0], "width": size[rid][1]})
             for rid in ("e", "t") for tag in ("gen", "cfg_text", "cfg_img")]
    together = r.run("denoise", items)
    for (rid, tag, inputs), out in zip(items, together):
        alone = r.run("denoise", [(rid, tag, inputs)])[0]["velocity"]
        want = refs[rid, tag].velocity(x[rid], times[rid], *size[rid])
        assert close(out["velocity"], alone) and close(alone, want), (rid, tag)
    v = {tag: together[i]["velocity"] for i, tag in enumerate(("gen", "cfg_text", "cfg_img"))}
    assert not close(v["gen"], v["cfg_text"]) and not close(v["gen"], v["cfg_img"])  # three contexts
    assert close(together[3]["velocity"], together[5]["velocity"])  # t2i: cfg_img holds what gen holds


# --------------------------------------------------------------------- (e): empty latent
def test_an_empty_latent_gives_an_empty_velocity_and_no_work(node: MoTLanguageModel) -> None:
    calls: list[int] = []

    def counting(q: torch.Tensor, pool: Any, layer: int, meta: Any, scale: float | None) -> torch.Tensor:
        calls.append(q.shape[0])
        return paged_attention(q, pool, layer, meta, scale)

    r = Runner(node, backend=counting)
    r.one("prefill_text", "r", "gen", text=text(30, 5))
    r.fork("r", "gen", "cfg_text")
    calls.clear()
    empty = torch.zeros(0, 16)
    off = {"latent": empty, "t": 0.5, "height": 64, "width": 64}
    out = r.run("denoise", [("r", "gen", off), ("r", "cfg_text", off)])
    assert [o["velocity"].shape for o in out] == [(0, 16), (0, 16)] and calls == []
    assert r.bm.seq_len(("r", "gen")) == 5
    latent = randn(31, 16, 16)
    on = {"latent": latent, "t": 0.5, "height": 64, "width": 64}
    mixed = r.run("denoise", [("r", "cfg_text", off), ("r", "gen", on)])
    assert mixed[0]["velocity"].shape == (0, 16)
    assert calls == [18] * CONFIG["layers"]  # only the live entry's 16 + 2 queries, once per layer
    assert close(mixed[1]["velocity"], r.one("denoise", "r", "gen", **on)["velocity"])
    assert MoTLanguageModel.kv_plan("denoise", {"latent": (0, 16)}, node.spec).q_len == 0


# ------------------------------------------------------------------------ (f): stopping
def _reply(r: Runner, n: int, **start: Any) -> list[dict[str, Any]]:
    r.one("prefill_text", "r", "gen", text=text(40, 4))
    outs = [r.one("start", "r", "gen", **{"temperature": 0.0, "max_length": 50, **start})]
    for _ in range(n - 1):
        outs.append(r.one("decode", "r", "gen", token=outs[-1]["token"]))
    return outs


@pytest.mark.parametrize("token, opens", [(EOS, False), (VS, True)])
def test_done_on_im_end_and_on_vision_start(node: MoTLanguageModel, monkeypatch: pytest.MonkeyPatch,
                                            token: int, opens: bool) -> None:
    monkeypatch.setattr(node, "head", Logits(node, force={2: token}))
    outs = _reply(Runner(node), 4)  # the 4th step is a decode after done: it must run
    assert [o["done"] for o in outs[:3]] == [False, False, True]
    assert [o["image_start"] for o in outs[:3]] == [False, False, opens]
    assert int(outs[2]["token"]) == token


def test_done_at_max_length_max_text_tokens_and_the_context(node: MoTLanguageModel) -> None:
    outs = _reply(Runner(node), 4, max_length=3)
    assert [o["done"] for o in outs] == [False, False, True, True]
    capped = build({"max_text_tokens": 2}, weights=node)
    assert [o["done"] for o in _reply(Runner(capped), 3, max_length=10)] == [False, True, True]
    # a context of 7: 4 prompt tokens + <|im_start|> + 2 fed tokens; the step that fills it is done
    short = build(weights=node, max_seq_len=7)
    assert [o["done"] for o in _reply(Runner(short), 4)] == [False, False, True, True]
    assert outs[0]["image_start"] is False


def test_lazy_outputs_resolve_to_the_plain_values(node: MoTLanguageModel) -> None:
    """`start`'s GPU output form (readback.Lazy), exercised on the CPU, and `decode`'s (the
    column step's: Lazy on every device): the same values once resolved."""
    replies = {}
    for lazy in (False, True):
        n = build(weights=node)
        n.lazy_outputs = lazy
        n.head = Logits(n, force={1: VS})  # type: ignore[method-assign]
        replies[lazy] = _reply(Runner(n, lazy=True), 3, max_length=3)
    flags = ("emitted", "done", "image_start")
    assert all(isinstance(o[k], Lazy) for o in (replies[True][0], *replies[False][1:]) for k in flags)
    assert not any(isinstance(replies[False][0][k], Lazy) for k in flags)
    values = {lazy: [(int(o["token"]), resolve(o["emitted"]).tolist(), resolve(o["done"]), resolve(o["image_start"]))
                     for o in outs] for lazy, outs in replies.items()}
    assert values[True] == values[False]
    assert [v[2:] for v in values[False]] == [(False, False), (True, True), (True, False)]
    assert all(v[1] == [v[0]] for v in values[True])
    # a `done` that a host limit raises at `start` is a plain value
    n = build(weights=node)
    n.lazy_outputs = True
    r = Runner(n, lazy=True)
    r.one("prefill_text", "r", "gen", text=text(40, 4))
    assert r.one("start", "r", "gen", temperature=0.0, max_length=1)["done"] is True


def test_sampling_is_seeded_and_batch_independent(node: MoTLanguageModel) -> None:
    def reply(runner: Runner, rid: str, seed: int, n: int = 6) -> list[int]:
        runner.one("prefill_text", rid, "gen", text=text(50, 5))
        out = runner.one("start", rid, "gen", temperature=1.5, max_length=50, seed=seed)
        tokens = [int(out["token"])]
        for _ in range(n - 1):
            out = runner.one("decode", rid, "gen", token=out["token"])
            tokens.append(int(out["token"]))
        return tokens

    a, b = reply(Runner(node), "a", 1), reply(Runner(node), "a", 1)
    assert a == b and a != reply(Runner(node), "a", 2)
    # two requests stepped in one batch give what each gives alone
    r = Runner(node)
    for rid in ("x", "y"):
        r.one("prefill_text", rid, "gen", text=text(50, 5))
    outs = r.run("start", [(rid, "gen", {"temperature": 1.5, "max_length": 50, "seed": s})
                           for rid, s in (("x", 1), ("y", 2))])
    got = {"x": [int(outs[0]["token"])], "y": [int(outs[1]["token"])]}
    for _ in range(5):
        outs = r.run("decode", [(rid, "gen", {"token": o["token"]}) for rid, o in zip(("x", "y"), outs)])
        got["x"].append(int(outs[0]["token"]))
        got["y"].append(int(outs[1]["token"]))
    assert got["x"] == a and got["y"] == reply(Runner(node), "y", 2)


# --------------------------------------------------------------------------- the cohort
def test_cohort_decode_gives_the_generic_tokens(node: MoTLanguageModel) -> None:
    """Rows after image blocks (a RoPE offset), greedy and sampled, through `CohortColumns`
    (the worker's eager cohort step) against the generic `decode` phase."""
    steps = 6

    def setup(r: Runner, rid: str, i: int) -> dict[str, Any]:
        r.one("prefill_text", rid, "gen", text=text(60 + i, 3 + i))
        if i % 2:
            r.one("prefill_vit", rid, "gen", vit=randn(70 + i, 4, 64))
        return r.one("start", rid, "gen", temperature=0.0 if i == 0 else 1.2, max_length=4 + i, seed=i)

    rids = ["a", "b", "c"]
    generic = Runner(node)
    want: dict[str, list[tuple[int, int, bool, bool]]] = {}
    for i, rid in enumerate(rids):
        out = setup(generic, rid, i)
        want[rid] = []
        for _ in range(steps):
            out = generic.one("decode", rid, "gen", token=out["token"])
            want[rid].append((int(out["token"]), int(out["emitted"]), out["done"], out["image_start"]))

    r = Runner(node)
    shape = CohortShape("decode", (("token", "token"),), (), REPLY)
    cohort = CohortColumns(r.engine.pool, node.cohort_phase("decode"), shape, 4, PAGES, torch.device("cpu"),
                           scale=None, node="llm", q_heads=CONFIG["heads"])
    for row, (i, rid) in enumerate(zip(range(3), rids)):
        out = setup(r, rid, i)
        key = (rid, "gen")
        # room for every step: the cohort writes at the lengths, through the row's pages
        r.bm.append(key, steps)
        r.bm.set_length(key, r.bm.seq_len(key) - steps)
        cohort.join(row, r.engine.state(rid, "gen"), {"token": out["token"]}, {}, r.bm.page_table(key),
                    r.bm.seq_len(key))
    got: dict[str, list[tuple[int, int, bool, bool]]] = {rid: [] for rid in rids}
    for _ in range(steps):
        arrays = cohort.step(3).arrays()
        for row, rid in enumerate(rids):
            assert int(arrays["emitted:count"][row, 0]) == 1
            got[rid].append((int(arrays["token"][row, 0]), int(arrays["emitted"][row, 0]),
                             bool(arrays["done"][row, 0]), bool(arrays["image_start"][row, 0])))
    assert got == want


# ----------------------------------------------------------------- glue, plan and errors
def test_glue_matches_the_official_formulas() -> None:
    assert torch.allclose(sincos_2d(64, 4), sincos_table(64, 4))
    t = torch.tensor([0.0, 0.37, 1.0])
    assert torch.allclose(timestep_features(t, 256), torch.cat([timestep_embedding(float(x), 256) for x in t]))
    # t = 0 is not a zero embedding (cos 0 = 1), and t is not scaled by 1000
    assert timestep_features(torch.tensor([0.0]), 256)[0, :128].eq(1).all()
    assert torch.allclose(timestep_features(torch.tensor([1.0]), 256)[0, 0], torch.cos(torch.tensor(1.0)))


def test_the_plan_compiles_and_its_arch_names_are_the_modules(tmp_path: Path) -> None:
    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.weights import load_weights
    from mstarc.cli import main

    out = tmp_path / "tiny.plan"
    assert main(["compile", str(ROOT / "models/bagel/bagel.walk"), "--variant", "tiny", "-p",
                 str(ROOT / "placements/cpu.yaml"), "-o", str(out)]) == 0
    plan = load_plan(out)
    spec = plan.node_spec("llm", device="cpu")
    node = MoTLanguageModel(spec)
    load_weights(node, plan, "llm", "dummy")  # every arch tensor is a module tensor, same shapes
    assert (node.vocab, node.hidden, node.head_dim, node.patch_dim) == (300, 64, 16, spec.config["patch_dim"])
    assert (node.bos, node.eos, node.vision_start, node.vision_end) == tuple(
        spec.config[k] for k in ("bos_id", "eos_id", "vision_start_id", "vision_end_id"))
    # the fused GEMM storages are views of the loaded parameters
    layer = node.language_model.model.layers[0].self_attn
    assert node.experts[0][1].qkv_w[: layer.q_proj_moe_gen.weight.shape[0]].equal(layer.q_proj_moe_gen.weight)


def test_bad_inputs_are_request_errors(node: MoTLanguageModel) -> None:
    spec = node.spec
    plan = MoTLanguageModel.kv_plan
    with pytest.raises(RequestError, match="text"):
        plan("prefill_text", {"text": (0,)}, spec)
    with pytest.raises(RequestError, match="vit"):
        plan("prefill_vit", {"vit": (4, 32)}, spec)
    with pytest.raises(RequestError, match="latent"):
        plan("denoise", {"latent": (4,)}, spec)
    with pytest.raises(RequestError, match="max_seq_len"):
        plan("prefill_vae", {"clean": (5000, 16)}, spec)
    with pytest.raises(NodeError):
        plan("generate", {}, spec)
    r = Runner(node)
    with pytest.raises(RequestError, match=r"\[0, 300\)"):
        r.one("prefill_text", "r", "gen", text=torch.tensor([1, 300]))
    r2 = Runner(node)
    with pytest.raises(RequestError, match="decode"):
        r2.one("decode", "r", "gen", token=torch.tensor([5], dtype=torch.int32))
    # the fed-back token, checked at the column step's join before any step runs
    r2.one("prefill_text", "s", "gen", text=text(41, 3))
    r2.one("start", "s", "gen", temperature=0.0, max_length=5)
    for bad in (torch.tensor([5.0]), torch.tensor([5, 6], dtype=torch.int32), 5, "five"):
        with pytest.raises(RequestError, match="token") as err:
            r2.one("decode", "s", "gen", token=bad)
        assert err.value.field == "token"
    with pytest.raises(RequestError, match="2x2 = 4"):
        r2.one("denoise", "r", "gen", latent=torch.zeros(5, 16), t=0.5, height=32, width=32)
    with pytest.raises(RequestError, match="image size 80x80"):
        r2.one("denoise", "r", "gen", latent=torch.zeros(25, 16), t=0.5, height=80, width=80)
    with pytest.raises(RequestError, match="'t'"):
        r2.one("denoise", "r", "gen", latent=torch.zeros(4, 16), t="late", height=32, width=32)
    with pytest.raises(RequestError, match="temperature"):
        r2.one("start", "r", "gen", temperature=-1.0, max_length=5)
    with pytest.raises(RequestError, match="max_length"):
        r2.one("start", "r", "gen", temperature=0.0, max_length=0)
    with pytest.raises(NodeError, match="shard"):
        MoTLanguageModel(dataclasses.replace(spec, tp_size=2))


# ------------------------------------------------------------------------------------ GPU
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.gpu
def test_gpu_flashinfer_graphs_and_lazy_outputs_follow_the_reference(cuda: torch.device,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on the GPU, FlashInfer attention (causal, full and mixed batches), decode steps
    (the column step as a plain call, in an engine with decode graphs as the plan gives it:
    the step attends eagerly beside them) and Lazy outputs, against the float32 CPU reference
    (head_dim 128, which FlashInfer is compiled for). Teacher-forced with the reference's
    greedy tokens, so that a bf16 near-tie cannot make the two sequences diverge."""
    from mstar_runtime.kv.flashinfer_backend import select_backend

    config = {"hidden": 512, "heads": 4, "kv_heads": 2, "head_dim": 128, "intermediate": 1024}
    cpu = build(config)
    gpu = MoTLanguageModel(make_spec(config, torch.bfloat16, cuda))
    gpu.load_state_dict(cpu.state_dict(), strict=True)
    gpu.eval().requires_grad_(False)
    assert gpu.lazy_outputs
    # the logits as the samplers get them (`start`'s and the column step's): outside any
    # captured graph (a wrapped head would be called at capture only)
    rows: list[torch.Tensor] = []

    def recording(logits: torch.Tensor, *args: Any) -> torch.Tensor:
        rows.append(logits.clone())
        return sample(logits, *args)

    def recording_columns(logits: torch.Tensor, *args: Any) -> torch.Tensor:
        rows.append(logits.clone())
        return sample_columns(logits, *args)

    monkeypatch.setattr(mot, "sample", recording)
    monkeypatch.setattr(mot, "sample_columns", recording_columns)
    r = Runner(gpu, backend=select_backend(cuda), graphs={"decode": [1, 2, 4]})
    ref = {tag: reference(cpu) for tag in ("gen", "cfg_img")}
    t1, vit, clean, t2 = text(80, 7), randn(81, 6, 512), randn(82, 4, 16), text(83, 5)
    r.one("prefill_text", "r", "gen", text=t1.to(cuda))
    r.one("prefill_vit", "r", "gen", vit=vit.to(cuda, torch.bfloat16))
    r.one("prefill_vae", "r", "gen", clean=clean.to(cuda), height=32, width=32)
    r.fork("r", "gen", "cfg_text")
    r.one("prefill_text", "r", "gen", text=t2.to(cuda))
    r.one("prefill_text", "r", "cfg_img", text=t2.to(cuda))
    ref["gen"].text(t1)
    ref["gen"].vit(vit.to(torch.bfloat16).float())
    ref["gen"].vae(clean, 32, 32)
    ref["cfg_text"] = ref["gen"].copy()
    ref["gen"].text(t2)
    ref["cfg_img"].text(t2)
    latent = randn(84, 16, 16)
    outs = r.run("denoise", [("r", tag, {"latent": latent.to(cuda), "t": 0.6, "height": 64, "width": 64})
                             for tag in ("gen", "cfg_text", "cfg_img")])
    for tag, out in zip(("gen", "cfg_text", "cfg_img"), outs):
        err = rel(out["velocity"], ref[tag].velocity(latent, 0.6, 64, 64))
        assert err < 3e-2, f"{tag}: velocity relative error {err:.2e}"
    out = r.one("start", "r", "gen", temperature=0.0, max_length=50)
    want = [ref["gen"].step(BOS)]
    for _ in range(6):
        assert resolve(out["done"]) in (False, True)
        token = int(want[-1].argmax())
        want.append(ref["gen"].step(token))
        out = r.one("decode", "r", "gen", token=torch.tensor([token], dtype=torch.int32, device=cuda))
    err = rel(torch.cat(rows), torch.stack(want))
    assert err < 3e-2, f"logits relative error {err:.2e}"
    assert "decode" in r.engine.graph_runners
