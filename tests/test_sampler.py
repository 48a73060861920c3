"""Sampling: Hugging Face's processing, reproducible draws that ignore batch composition, valid params."""

from __future__ import annotations

import pytest
import torch
from support import capture

from mstar_runtime.ops.node import RequestError
from mstar_runtime.sampling import (
    SamplingColumns,
    SamplingParams,
    process_logits,
    sample,
    sample_columns,
    sampling_row,
    uniform,
    uniforms,
)
from mstar_runtime.sampling import columns as sampling_columns
from mstar_runtime.sampling import stage as sampler

V = 97


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def history(seed: int, n: int = 12) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


MIXED = [
    SamplingParams(0.7, 5, 0.9, 1.3, seed=1),
    SamplingParams(1.0, 0, 0.5, 1.0, seed=2),
    SamplingParams(1.5, 10, 1.0, 0.8, seed=3),
    SamplingParams(0.0, 3, 0.2, 1.2, seed=4),
    SamplingParams(0.3, 1, 1.0, 1.0, seed=5),
    SamplingParams(1.0, 0, 1.0, 1.0, seed=None),
    SamplingParams(0.9, 200, 0.95, 2.0, seed=7),
]


def test_greedy_is_argmax_after_the_penalty() -> None:
    x = logits(3)
    params = [SamplingParams(temperature=0.0)] * 3
    assert torch.equal(sample(x, params, [None] * 3, [0, 1, 2]), x.argmax(-1))
    # the penalty applies to greedy decoding too (as in HF's generate)
    top = int(x[0].argmax())
    x[0, top] = x[0].max() + 0.1
    pen = [SamplingParams(temperature=0.0, repetition_penalty=1e6)]
    assert int(sample(x[:1], pen, [torch.tensor([top])], [0])[0]) != top


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    x = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    out = process_logits(x, [SamplingParams(repetition_penalty=2.0)], [torch.tensor([0, 1, 1, 7])])
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 1.0, -1.0, 0.5]]))  # id 7 is beyond the vocab: ignored


def test_matches_huggingface_processors() -> None:
    hf = pytest.importorskip("transformers.generation.logits_process")
    x = logits(len(MIXED), seed=3)
    hists = [history(i) if i % 3 else None for i in range(len(MIXED))]
    mine = process_logits(x, MIXED, hists)
    for b, p in enumerate(MIXED):
        ref = x[b : b + 1].clone()
        if hists[b] is not None and p.repetition_penalty != 1.0:
            ref = hf.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(hists[b][None], ref)
        if p.temperature == 0:  # greedy: only the penalty
            assert torch.equal(mine[b], ref[0])
            continue
        if p.temperature != 1.0:
            ref = hf.TemperatureLogitsWarper(p.temperature)(None, ref)
        if p.top_k:
            ref = hf.TopKLogitsWarper(p.top_k)(None, ref)
        if p.top_p < 1.0:
            ref = hf.TopPLogitsWarper(p.top_p)(None, ref)
        assert torch.equal(torch.isinf(mine[b]), torch.isinf(ref[0])), b
        kept = ~torch.isinf(ref[0])
        assert torch.allclose(mine[b][kept], ref[0][kept], rtol=0, atol=1e-6), b


def test_a_row_ignores_the_rest_of_the_batch() -> None:
    x = logits(len(MIXED), seed=4)
    seeded = [b for b, p in enumerate(MIXED) if p.seed is not None]
    hists = [history(10 + b) for b in range(len(MIXED))]
    steps = [5, 9, 0, 3, 2, 1, 40]
    batched = sample(x, MIXED, hists, steps)
    for b in seeded:
        alone = sample(x[b : b + 1], [MIXED[b]], [hists[b]], [steps[b]])
        assert int(alone[0]) == int(batched[b]), b
    # and in another order, next to other rows
    order = list(reversed(seeded))
    shuffled = sample(
        x[order], [MIXED[b] for b in order], [hists[b] for b in order], [steps[b] for b in order]
    )
    assert [int(t) for t in shuffled] == [int(batched[b]) for b in order]


def test_a_recomputed_request_replays_its_tokens() -> None:
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    x = logits(1, seed=9)
    first = [int(sample(x, [p], [None], [n])[0]) for n in range(30)]
    again = [int(sample(x, [p], [None], [n])[0]) for n in range(30)]
    assert first == again and len(set(first)) > 3  # and the steps really draw different tokens
    other = [int(sample(x, [SamplingParams(top_p=0.95, seed=4321)], [None], [n])[0]) for n in range(30)]
    assert other != first


def test_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20000
    rows = probs.log()[None].expand(n, 4)
    toks = sample(rows, [SamplingParams(seed=7)] * n, [None] * n, list(range(n)))
    freq = torch.bincount(toks, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.015), freq
    # with temperature 0.5 the distribution sharpens to probs**2 / sum
    toks = sample(rows, [SamplingParams(temperature=0.5, seed=8)] * n, [None] * n, list(range(n)))
    sharp = probs**2 / (probs**2).sum()
    assert torch.allclose(torch.bincount(toks, minlength=4).float() / n, sharp, atol=0.015)


def test_filtered_tokens_are_never_drawn() -> None:
    x = logits(1, seed=11)
    top3 = set(x[0].topk(3).indices.tolist())
    drawn = {
        int(sample(x, [SamplingParams(temperature=2.0, top_k=3, seed=1)], [None], [n])[0]) for n in range(300)
    }
    assert drawn <= top3 and len(drawn) > 1
    nucleus = {int(sample(x, [SamplingParams(top_p=1e-6, seed=1)], [None], [n])[0]) for n in range(50)}
    assert nucleus == {int(x[0].argmax())}  # top-p keeps at least the most likely token


def test_uniform_draws_are_a_pure_function_of_seed_and_step() -> None:
    draws = [uniform(42, n) for n in range(20000)]
    assert draws == [uniform(42, n) for n in range(20000)]
    assert all(0.0 <= u < 1.0 for u in draws) and len(set(draws)) == len(draws)
    mean = sum(draws) / len(draws)
    var = sum((u - mean) ** 2 for u in draws) / len(draws)
    assert abs(mean - 0.5) < 0.01 and abs(var - 1 / 12) < 0.003
    assert uniform(43, 0) != uniform(42, 0) and uniform(2**70 + 42, 0) == uniform(42, 0)  # seeds are 64-bit


def test_zero_probability_tokens_are_never_drawn_even_at_the_edge(monkeypatch: pytest.MonkeyPatch) -> None:

    x = torch.full((1, V), float("-inf"))
    x[0, 10], x[0, 20] = 0.0, 0.0
    for u in (0.0, 0.5 - 1e-12, 0.5, 1.0 - 2.0**-53):
        fixed = torch.tensor([u], dtype=torch.float64)
        monkeypatch.setattr(sampler, "uniforms", lambda seed, step, fixed=fixed: fixed)
        assert int(sample(x, [SamplingParams(seed=1)], [None], [0])[0]) in (10, 20)
    assert [int(t) for t in sampler.pick_from_cdf(x.expand(2, V), torch.tensor([0.0, 0.75]).double())] == [10, 20]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and field in str(info.value)


def test_with_seed_and_shape_checks() -> None:
    p = SamplingParams().with_seed()
    assert p.seed is not None and p.with_seed() is p
    with pytest.raises(ValueError, match="need logits"):
        sample(logits(2), [p], [None], [0])
    with pytest.raises(ValueError, match="one step per row"):
        sample(logits(1), [p], [None], [0, 1])


# ------------------------------------------------------------------ device-side, batched draws
def test_tensor_uniforms_are_the_host_bits() -> None:
    """The per-row uniform computed with int64 tensor ops (wrapping adds and multiplies, masked
    shifts) equals the host `uniform` bit for bit, for seeds and steps that overflow int64."""
    seeds = [0, 1, 42, 2**63 - 1, 2**63, 2**64 - 1, 2**70 + 42, -1, -(2**63), 12345678901234567]
    steps = [0, 1, 7, 2**31, 2**62 + 3, 2**64 - 2]
    pairs = [(s, t) for s in seeds for t in steps]
    st = sampling_columns.columns_of([SamplingParams(seed=s) for s, _ in pairs], [None] * len(pairs),
                                  [t for _, t in pairs], "cpu")
    got = uniforms(st.seed, st.step).tolist()
    assert got == [uniform(s, t) for s, t in pairs]


def test_a_row_ignores_its_batch_in_every_position() -> None:
    """Each row drawn alone, in a batch of 7, in a batch of 64 at another position, with penalties,
    greedy neighbours and different history lengths: always the same token."""
    x = logits(64, seed=21)
    params = [MIXED[b % len(MIXED)] for b in range(64)]
    params = [p if p.seed is not None else SamplingParams(0.8, 0, 0.9, 1.1, seed=99) for p in params]
    hists = [history(100 + b, n=1 + (5 * b) % 30) if b % 4 else None for b in range(64)]
    steps = [3 * b + 1 for b in range(64)]
    full = sample(x, params, hists, steps)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(5)).tolist()
    shuffled = sample(x[perm], [params[b] for b in perm], [hists[b] for b in perm], [steps[b] for b in perm])
    assert [int(t) for t in shuffled] == [int(full[b]) for b in perm]
    for b in range(0, 64, 9):
        alone = sample(x[b : b + 1], [params[b]], [hists[b]], [steps[b]])
        assert int(alone[0]) == int(full[b]), b


def test_repeated_calls_give_identical_tokens() -> None:
    x = logits(32, seed=22)
    params = [SamplingParams(0.7, 20 * (b % 3), 0.8 + 0.01 * (b % 10), 1.3, seed=1000 + b) for b in range(32)]
    hists = [history(200 + b) for b in range(32)]
    first = sample(x, params, hists, list(range(32)))
    for _ in range(3):
        assert torch.equal(sample(x, params, hists, list(range(32))), first)


def test_device_joined_histories_equal_host_padded() -> None:
    """The path for histories that live on the device (one cat + one gather) pads exactly as the host path."""
    hs = [history(b, n=3 + 4 * b) for b in range(5)]
    host = sampling_columns.pad_histories(hs, [0, 2, 3, 4], 5, torch.device("cpu"))
    joined = sampling_columns.join_histories({b: hs[b] for b in (0, 2, 3, 4)}, 5, host.shape[1], torch.device("cpu"))
    assert torch.equal(host, joined) and bool((host[1] == -1).all())


def test_penalty_ignores_padding_and_out_of_vocab_ids_in_a_batch() -> None:
    x = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5], [1.0, 1.0, 1.0, 1.0, 1.0]])
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(repetition_penalty=1.0)]
    out = process_logits(x, params, [torch.tensor([0, 1, 1, 7, -3]), torch.tensor([0, 1, 2])])
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 1.0, -1.0, 0.5], [1.0, 1.0, 1.0, 1.0, 1.0]]))


@pytest.mark.parametrize("v", [4096, 156940])
def test_the_blocked_scan_equals_the_plain_cumsum(v: int) -> None:
    """The GPU's blocked scan (sampler._cumsum) is the cumsum up to rounding, on ragged last blocks too."""
    g = torch.Generator().manual_seed(v)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        p = torch.softmax(torch.randn(3, v, generator=g, dtype=torch.float64) * 3, dim=-1).to(dtype)
        got = sampler._cumsum(p, blocked=True)
        assert got.shape == p.shape and got.dtype == dtype
        torch.testing.assert_close(got, p.cumsum(-1), rtol=0, atol=tol)
    assert torch.equal(sampler._cumsum(p[:, :100], blocked=True), p[:, :100].cumsum(-1))  # short rows: plain


@pytest.mark.parametrize("v", [5000, 156940])
def test_a_draw_from_the_blocked_cdf_is_the_same_draw(v: int) -> None:
    """pick_from_cdf's blocked draw (the GPU's: the block found first, then only its entries
    searched) picks what the whole-row search picks, at the edges too (u = 0, u just below 1
    where u * total may round up to the total, a draw in the last, ragged block, a row whose
    probability ends inside a block)."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(6, v, generator=g) * 2
    scores[:, v - 1000 :] = float("-inf")  # zero-probability tail, as top-p leaves
    scores[4, : v - 1020] = float("-inf")  # all mass in the last 20 live tokens (the last blocks)
    scores[5, 1500:] = float("-inf")  # the mass ends inside the second block
    u = torch.tensor([0.0, 0.3, 0.999999, 1.0 - 2.0**-53, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    plain = sampler.pick_from_cdf(scores, u, blocked=False)
    assert torch.equal(sampler.pick_from_cdf(scores, u, blocked=True), plain)
    assert bool((plain < v - 1000).all()) and int(plain[4]) >= v - 1020 and int(plain[5]) < 1500
    nan = torch.full((2, v), float("nan"))  # a padding row of a captured bucket: token 0 on both paths
    assert sampler.pick_from_cdf(nan, u[:2], blocked=True).tolist() == [0, 0]
    assert sampler.pick_from_cdf(nan, u[:2], blocked=False).tolist() == [0, 0]
    for seed in range(20):  # many draws over a whole row
        u = torch.rand(6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        assert torch.equal(sampler.pick_from_cdf(scores, u, blocked=True), sampler.pick_from_cdf(scores, u, blocked=False))


# --------------------------------------------------------------------------- cohort columns
def columns(params: list[SamplingParams], hists: list[torch.Tensor | None], steps: list[int]) -> SamplingColumns:
    """The cohort's columns of these rows, stacked from `sampling_row` as the cohort does."""
    rows = [sampling_row(p, s) for p, s in zip(params, steps, strict=True)]
    stack = {name: torch.stack([r[name] for r in rows]) for name in rows[0]}
    width = max((h.numel() for h in hists if h is not None), default=0)
    hist = torch.full((len(params), max(width, 1)), -1, dtype=torch.int64)
    for b, h in enumerate(hists):
        if h is not None:
            hist[b, : h.numel()] = h
    return SamplingColumns(history=hist, **stack)


COLUMN_KS = [0, 1, 2, 5, 20, V - 1, V, V + 50]


@pytest.mark.parametrize("round_to", [None, 1.0])  # 1.0: many tied logits, at the k-th value and in top-p
def test_column_sampler_with_per_row_top_k_equals_sample_row_by_row(round_to: float | None) -> None:
    g = torch.Generator().manual_seed(11)
    for trial in range(12):
        n = 16
        params = [
            SamplingParams(
                temperature=[0.0, 0.4, 1.0, 1.7][int(torch.randint(4, (1,), generator=g))],
                top_k=COLUMN_KS[int(torch.randint(len(COLUMN_KS), (1,), generator=g))],
                top_p=[1.0, 0.9, 0.5, 0.1][int(torch.randint(4, (1,), generator=g))],
                repetition_penalty=[1.0, 1.3, 0.8][int(torch.randint(3, (1,), generator=g))],
                seed=int(torch.randint(2**62, (1,), generator=g)),
            )
            for _ in range(n)
        ]
        hists = [history(100 * trial + b) if p.repetition_penalty != 1.0 else None for b, p in enumerate(params)]
        x = logits(n, seed=trial)
        if round_to is not None:
            x = (x / round_to).round() * round_to
        for step in (0, 1, 7, 1000):
            steps = [step + b for b in range(n)]
            got = sample_columns(x, columns(params, hists, steps))
            want = torch.cat([sample(x[b : b + 1], [params[b]], [hists[b]], [steps[b]]) for b in range(n)])
            assert torch.equal(got, want), (trial, step, params)


def test_column_top_k_is_the_generic_top_k() -> None:
    """Top-k alone (no top-p, temperature 1, no penalty): the columns keep exactly the generic
    path's tokens per row, and a k that is off keeps them all."""
    x = logits(len(COLUMN_KS), seed=3)
    params = [SamplingParams(top_k=k, seed=k) for k in COLUMN_KS]
    kept = process_logits(x, params, [None] * len(params)).isfinite()
    for b, k in enumerate(COLUMN_KS):
        assert int(kept[b].sum()) == (k if 0 < k < V else V)
        # every draw of the column sampler lands inside the row's top-k
        cols = columns([params[b]] * 64, [None] * 64, list(range(64)))
        assert kept[b][sample_columns(x[b].expand(64, V), cols)].all()
    assert not sampling_row(SamplingParams(temperature=0.0, top_k=5), 0)["top_k"]  # greedy: off


@pytest.mark.gpu
def test_column_top_k_in_a_cuda_graph_equals_sample_row_by_row() -> None:
    """One captured step, replayed with other k, p and steps written into the same columns
    (k varies per row and between replays): the tokens `sample` gives each row on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev, n, vocab = torch.device("cuda"), 8, 151_936  # a real vocabulary: the blocked scan runs
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(n, vocab, generator=g) * 4).to(dev)

    def settings(r: int) -> list[SamplingParams]:
        ks = [0, 1, 20, 50, 200, vocab, 7, 20][r:] + [0, 1, 20, 50, 200, vocab, 7, 20][:r]
        return [SamplingParams(0.7 if b % 3 else 1.3, ks[b], [0.8, 1.0][(b + r) % 2], seed=100 * r + b)
                for b in range(n)]

    def host_cols(r: int) -> SamplingColumns:
        return columns(settings(r), [None] * n, [r * 10 + b for b in range(n)])

    cols = SamplingColumns(**{f: (None if t is None else t.to(dev))
                              for f, t in vars(host_cols(0)).items()})  # type: ignore[arg-type]
    graph, out = capture(sample_columns, x, cols)
    for r in range(4):
        for f, t in vars(host_cols(r)).items():
            getattr(cols, f).copy_(t)
        graph.replay()
        params, steps = settings(r), [r * 10 + b for b in range(n)]
        want = torch.cat([sample(x[b : b + 1], [params[b]], [None], [steps[b]]) for b in range(n)])
        assert torch.equal(out, want), r
