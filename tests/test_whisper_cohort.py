"""Whisper's decoder `step` as a cohort column step (`Decoder.cohort_phase`, whisper/decoder.py) on CPU.

The column step is the decoder's only `step`. Over several rows, as a cohort (its columns
kept over the steps) and in plain calls (`Decoder.run`: each call joins the host state,
steps once and leaves it, ops/column_call.py), it gives bit for bit the numbers of the
host-side pick that prefill makes of its first token (`_next`, per-entry state; the way the
deleted `phase_step` went): tokens, log-probabilities, `done` and the state its leave writes
back (so a later plain call continues the same), greedy and sampled (the fixed top-k),
timestamps on and off, `min_tokens` > 0, a row that reaches `max_tokens` and one that fills
the 448 positions. Every path attends through the same per-row attention over plain tensors
(`Contexts`), so what is compared is the node's own code. A plain call's errors name the
port: a context never prefilled, a malformed fed token; a step before `listen` (its `cross`
context empty) is refused. Then the `transcribe` walk on the tiny checkpoint
through the runtime, the decode loop as a cohort and on the generic path: the same tokens,
text, language and segments (their float statistics to float32 rounding: the paths' attention
kernels differ).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support import as_run
from test_whisper import _audio, plan, reference  # noqa: F401 - fixtures

from mstar_models.whisper.decoder import Decoder
from mstar_runtime.api import MStar
from mstar_runtime.ops.cohort import CohortStep
from mstar_runtime.ops.node import AttentionContext, RequestError, SeqState
from mstar_runtime.ops.readback import Lazy
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.weights import build_node
from mstarc.cli import main as mstarc

ROOT = Path(__file__).resolve().parent.parent
STEPS = 12


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Decoder:
    """The tiny variant's decoder, its seeded weights perturbed (so scores are not nearly flat),
    `<|endoftext|>`'s embedding along the final norm's bias (so that it wins in some rows,
    sooner or later, and not in others)."""
    out = tmp_path_factory.mktemp("whisper-cohort") / "whisper-tiny.plan"
    assert mstarc(["compile", str(ROOT / "models/whisper/whisper.walk"), "--variant", "tiny", "-p",
                   str(ROOT / "placements/cpu.yaml"), "-o", str(out)]) == 0
    dec = build_node(load_plan(out), "decoder", 0, "cpu")
    assert isinstance(dec, Decoder)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in dec.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        dec.embed_tokens.weight[dec.layout.eot] = 3 * dec.layer_norm.bias
    return dec


class Contexts:
    """Each row's own K/V (grown by every call) and its cross K/V, attended row by row: the one
    attention both the generic `AttentionContext` and the `CohortStep` call here."""

    def __init__(self, cross: list[list[tuple[torch.Tensor, torch.Tensor]]]):
        self.cross = cross  # row -> layer -> (k, v) [frames, heads, D]
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.q_lens: list[int] = []

    def length(self, row: int) -> int:
        got = self.kv.get((row, 0))
        return 0 if got is None else got[0].shape[0]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs, at = [], 0
        for row, ql in enumerate(self.q_lens):
            kk, vv = k[at : at + ql], v[at : at + ql]
            if (row, layer) in self.kv:
                old_k, old_v = self.kv[(row, layer)]
                kk, vv = torch.cat([old_k, kk]), torch.cat([old_v, vv])
            self.kv[(row, layer)] = (kk, vv)
            mask = torch.ones(ql, kk.shape[0], dtype=torch.bool).tril(kk.shape[0] - ql)
            outs.append(_sdpa(q[at : at + ql], kk, vv, mask))
            at += ql
        return torch.cat(outs)

    def attend_to(self, layer: int, q: torch.Tensor, context: int | str = 0) -> torch.Tensor:
        assert context == 0
        outs, at = [], 0
        for row, ql in enumerate(self.q_lens):
            ck, cv = self.cross[row][layer]
            outs.append(_sdpa(q[at : at + ql], ck, cv, None))
            at += ql
        return torch.cat(outs)

    def context(self, states: list[dict[str, Any]], q_lens: list[int]) -> AttentionContext:
        """The generic path's context for one call (rows in order, `q_lens` new tokens each)."""
        self.q_lens = q_lens
        seqs = [SeqState(start=self.length(r), q_len=ql, state=st, read_lens=(self.cross[r][0][0].shape[0],))
                for r, (st, ql) in enumerate(zip(states, q_lens, strict=True))]

        def read(layer: int, q: torch.Tensor, k: object, v: object, over: tuple[int, ...]) -> torch.Tensor:
            assert k is None and over == (0,)
            return self.attend_to(layer, q, 0)

        return AttentionContext(seqs=seqs, attend_fn=self.attend, device=torch.device("cpu"),
                                reads=("decoder@cross",), read_fn=read)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return o.transpose(0, 1)


# (timestamps, temperature, seed, max_tokens, min_tokens, prompt words): greedy and sampled,
# timestamps on and off, min_tokens, a row that stops at max_tokens, one that fills 448 positions
ROWS = {
    "greedy": (False, 0.0, 0, 30, 0, 0),
    "greedy, timestamps, min": (True, 0.0, 0, 30, 6, 3),
    "sampled, timestamps": (True, 0.8, 3, 30, 0, 0),
    "sampled, min, max": (False, 1.0, 7, 5, 4, 1),
    "sampled, timestamps, min, long prompt": (True, 0.5, 11, 30, 10, 436),
}
CASES = {"mixed": list(ROWS), "greedy only": ["greedy", "greedy, timestamps, min"],
         "sampled only": ["sampled, timestamps", "sampled, min, max", "sampled, timestamps, min, long prompt"]}


def _prefill(dec: Decoder, rows: list[str]) -> tuple[Contexts, list[dict[str, Any]], torch.Tensor]:
    """The rows' prompts prefilled on the generic path: contexts, states, first tokens [n]."""
    lay, gen = dec.layout, torch.Generator().manual_seed(1)
    heads, d = dec.sizes.heads, dec.sizes.head_dim
    cross = [[(torch.randn(20 + 7 * r, heads, d, generator=gen), torch.randn(20 + 7 * r, heads, d, generator=gen))
              for _ in dec.layers] for r in range(len(rows))]
    batch = []
    for name in rows:
        timestamps, temperature, seed, max_tokens, min_tokens, words = ROWS[name]
        text = torch.randint(300, 5000, (words,), generator=gen).tolist()
        head = [lay.startofprev, *text, lay.sot] if words else [lay.sot]
        tail = [lay.transcribe] if timestamps else [lay.transcribe, lay.notimestamps]
        batch.append({"head": torch.tensor(head), "lang": torch.tensor([lay.language_token("en")]),
                      "tail": torch.tensor(tail), "timestamps": timestamps, "max_tokens": max_tokens,
                      "min_tokens": min_tokens, "temperature": temperature, "seed": seed})
    ctx = Contexts(cross)
    states: list[dict[str, Any]] = [{} for _ in rows]
    q_lens = [e["head"].numel() + 1 + e["tail"].numel() for e in batch]
    with torch.inference_mode():
        out = dec.run("prefill", batch, ctx.context(states, q_lens))
    return ctx, states, torch.cat([o["token"] for o in out])


def _plain_step(dec: Decoder, ctx: Contexts, states: list[dict[str, Any]], tokens: torch.Tensor) -> tuple:
    """One `step` as the generic path calls it: `Decoder.run` over the entries (a one-step
    cohort of the column step: ops/column_call.py)."""
    with torch.inference_mode():
        out = dec.run("step", [{"token": t.reshape(1)} for t in tokens], ctx.context(states, [1] * len(states)))
    return _results(out)


def _host_step(dec: Decoder, ctx: Contexts, states: list[dict[str, Any]], tokens: torch.Tensor) -> tuple:
    """The reference: the layer loop, then the host-side pick that prefill makes of its first
    token (`_next`: the state per entry, `sampling.sample`, a top-k per row), as the
    `phase_step` that the column step replaced did it."""
    attn = ctx.context(states, [1] * len(states))
    with torch.inference_mode():
        hidden = dec.forward_hidden(tokens.long(), attn.positions(), attn.attend, attn.attend_to)
        return _results(dec._next(dec.logits(hidden), attn))


def _results(out: list[dict[str, Any]]) -> tuple:
    done = [o["done"].get() if isinstance(o["done"], Lazy) else o["done"] for o in out]
    return (torch.cat([o["token"] for o in out]), torch.cat([o["logprob"] for o in out]), torch.tensor(done))


@pytest.mark.parametrize("case", list(CASES))
def test_column_step_equals_the_host_pick_as_a_cohort_and_in_plain_calls(decoder: Decoder, case: str) -> None:
    rows = CASES[case]
    ctx, states, first = _prefill(decoder, rows)
    g_ctx, g_states = copy.deepcopy(ctx), copy.deepcopy(states)  # plain calls
    h_ctx, h_states = copy.deepcopy(ctx), copy.deepcopy(states)  # the host reference
    phase = decoder.cohort_phase("step")
    assert phase is not None and decoder.cohort_phase("prefill") is None
    with torch.inference_mode():
        joined = [phase.join(st, {}) for st in states]
        cols = {name: torch.stack([j[name] for j in joined]) for name in joined[0]}
    ctx.q_lens = [1] * len(rows)
    g_tokens, h_tokens, c_tokens = first, first, first[:, None]
    eot = decoder.layout.eot
    stops, ends = torch.zeros(len(rows), dtype=torch.bool), torch.zeros(len(rows), dtype=torch.bool)
    for _ in range(STEPS):
        g_tokens, g_logprob, g_done = _plain_step(decoder, g_ctx, g_states, g_tokens)
        h_tokens, h_logprob, h_done = _host_step(decoder, h_ctx, h_states, h_tokens)
        positions = torch.tensor([ctx.length(r) for r in range(len(rows))])
        with torch.inference_mode():
            out = phase.step(CohortStep(len(rows), {"token": c_tokens}, cols, positions, ctx.attend,
                                        torch.device("cpu"), attend_to=ctx.attend_to))
        c_tokens = out["token"]
        assert out["token"].shape == (len(rows), 1) and out["token"].dtype == torch.int32
        assert out["logprob"].shape == (len(rows), 1) and out["logprob"].dtype == torch.float32
        assert out["done"].shape == (len(rows),) and out["done"].dtype == torch.bool
        for tokens, logprob, done in ((g_tokens, g_logprob, g_done), (h_tokens, h_logprob, h_done)):
            assert torch.equal(out["token"][:, 0], tokens)
            assert torch.equal(out["logprob"][:, 0], logprob)
            assert torch.equal(out["done"], done)
        assert torch.isfinite(h_logprob).all()
        stops |= h_done & (h_tokens != eot)
        ends |= h_tokens == eot
    if case == "mixed":  # every cause of `done` came up: <|endoftext|>, max_tokens, the 448 positions
        assert stops.tolist() == [False, False, False, True, True]
        assert ends.tolist() == [True, True, False, False, True]
    with torch.inference_mode():
        for r, st in enumerate(states):
            phase.leave(st, {name: col[r].clone() for name, col in cols.items()}, STEPS)
    for st, g, h in zip(states, g_states, h_states, strict=True):
        assert st["n"] == g["n"] == h["n"] == STEPS + 1
        for k in ("last", "penult", "ts_max"):
            assert torch.equal(st[k], g[k]) and torch.equal(st[k], h[k]), k
    # a later plain call continues where the cohort stopped, as the reference does
    after = _plain_step(decoder, ctx, states, c_tokens[:, 0])
    for other in (_plain_step(decoder, g_ctx, g_states, g_tokens), _host_step(decoder, h_ctx, h_states, h_tokens)):
        assert all(torch.equal(a, b) for a, b in zip(after, other, strict=True))


def test_join_declines_a_context_never_prefilled(decoder: Decoder) -> None:
    phase = decoder.cohort_phase("step")
    assert phase is not None
    with pytest.raises(RequestError, match="never prefilled"):
        phase.join({}, {})


def test_step_is_written_once() -> None:
    assert not hasattr(Decoder, "phase_step")  # the column step is the only `step`


@pytest.mark.parametrize("token", [torch.tensor([3.0]), torch.tensor([1, 2]), torch.tensor(3), 3,
                                   torch.tensor([True])])
def test_a_plain_step_names_a_malformed_token(decoder: Decoder, token: Any) -> None:
    ctx, states, _ = _prefill(decoder, ["greedy"])
    with pytest.raises(RequestError, match="token must be one integer token id of shape") as err:
        decoder.run("step", [{"token": token}], ctx.context(states, [1]))
    assert err.value.field == "token"


def test_a_plain_step_refuses_a_context_never_prefilled_or_an_empty_cross(decoder: Decoder) -> None:
    ctx, states, first = _prefill(decoder, ["greedy"])
    with pytest.raises(RequestError, match="never prefilled") as err:
        decoder.run("step", [{"token": first}], ctx.context([{}], [1]))
    assert err.value.field == "token"
    attn = ctx.context(states, [1])
    attn.seqs[0].read_lens = (0,)  # `listen` has not written the window's cross K/V
    with pytest.raises(RequestError, match="reads decoder@cross, which is empty"):
        decoder.run("step", [{"token": first}], attn)
    assert states[0]["n"] == 1  # nothing was stepped


# ------------------------------------------------------------------------------ the walk, cohort and generic
# the cases test_whisper.py's cohort-against-generic test has not: a given language, a detected one with
# min_tokens, 70 s of long form whose fallback is checked to have sampled
REQUESTS = {
    "timestamps, language given": (6.0, dict(language="de", timestamps=True)),
    "language detected, min tokens": (9.0, dict(min_tokens=12)),
    "long form, fallback": (70.0, dict(timestamps=True, compression_ratio_threshold=1.2,
                                       fallback_temperatures=torch.tensor([0.4, 1.0]), seed=2)),
}


def test_transcribe_is_the_same_as_a_cohort_and_on_the_generic_path(reference: tuple, plan: Path) -> None:  # noqa: F811
    """The `transcribe` walk on the tiny checkpoint, its requests together: the same tokens,
    text and segments with the decode loop as a cohort and on the generic path (the plan
    without its cohort marks)."""
    got: dict[str, list[dict[str, Any]]] = {}
    for path in ("cohort", "generic"):
        with MStar.from_plan(as_run(load_plan(plan), path), weights=reference[1]) as m:
            hs = [m.submit("transcribe", {"audio": torch.from_numpy(_audio(s, seed=i)), "max_tokens": 40, **kw})
                  for i, (s, kw) in enumerate(REQUESTS.values())]
            got[path] = [h.result(timeout=600) for h in hs]
            assert (m.stats()["cohort_steps"] > 0) == (path == "cohort")
    for name, a, b in zip(REQUESTS, got["cohort"], got["generic"], strict=True):
        assert a["tokens"].tolist() == b["tokens"].tolist(), name
        assert (a["text"], a["language"]) == (b["text"], b["language"]), name
        sa, sb = json.loads(a["segments"]), json.loads(b["segments"])
        exact = ("seek", "start", "end", "tokens", "temperature", "text")
        assert [{k: s[k] for k in exact} for s in sa] == [{k: s[k] for k in exact} for s in sb], name
        for k in ("avg_logprob", "compression_ratio", "no_speech_prob"):
            assert [s[k] for s in sa] == pytest.approx([s[k] for s in sb], rel=1e-5), (name, k)
    segments = json.loads(got["generic"][-1]["segments"])
    assert {s["temperature"] for s in segments} - {0.0}, "no window fell back to a sampled decode"
