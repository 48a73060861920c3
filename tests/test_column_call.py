"""A loop phase written once, as a column step, and run as a plain batched call (ops/column_call.py).

TinyLM, EchoLM, Orpheus' backbone and BAGEL's MoT LM write `decode` only as a column step
(Qwen3-Omni's thinker its `decode` and `decode_speech`, its talker `frame` and `frame_pad`):
`KVNode.run` runs it over a batch as a one-step cohort. Its tokens against the dense
reference are pinned in tests/test_testfamily.py (every decode there goes through it; BAGEL's
against transformers and its reference in tests/test_bagel_mot.py); here: that the nodes have
no second decode, what the call returns before anything is read back, where its items come
from, the node state it leaves, and its errors.

Also: that a block kept nowhere needs an empty own context (only there is the engine's
read attention a cohort's `attend_block`). π0.5's action expert writes `step` only as a
column step too; its generic-path chunks against the reference are in tests/test_pi05.py.

And a step that reads another context (as Whisper's decoder `step` reads its `cross`
context) through a plain call: its `attend_to`, and an empty read context refused.
"""

from __future__ import annotations

import pytest
import torch

from mstar_models.bagel.mot import MoTLanguageModel
from mstar_models.orpheus.backbone import LlamaBackbone
from mstar_models.qwen3_omni.talker import TalkerMoE
from mstar_models.qwen3_omni.thinker import ThinkerMoE
from mstar_models.testfamily import TinyLM
from mstar_models.testfamily import reference as R
from mstar_models.testfamily.echo import EchoLM
from mstar_models.testfamily.family import Family, build_family
from mstar_runtime.ops import column_call
from mstar_runtime.ops.cohort import CohortPhase, CohortStep
from mstar_runtime.ops.column_call import run_columns
from mstar_runtime.ops.node import AttentionContext, NodeError, RequestError, SeqState
from mstar_runtime.ops.readback import Lazy, Readback
from tests.test_testfamily import PagedKV, encode


@pytest.fixture(scope="module")
def family() -> Family:
    return build_family("tiny")


@pytest.mark.parametrize("cls", [TinyLM, EchoLM, LlamaBackbone, MoTLanguageModel])
def test_decode_is_written_once(cls: type) -> None:
    assert not hasattr(cls, "phase_decode")  # the column step is the only decode


@pytest.mark.parametrize(("cls", "phases"), [(ThinkerMoE, ("decode", "decode_speech")),
                                             (TalkerMoE, ("frame", "frame_pad"))])
def test_qwen3_omni_loop_phases_are_written_once(cls: type, phases: tuple[str, ...]) -> None:
    """The speech loop's two calls a step run their column steps as plain calls (the parity
    with transformers: tests/test_qwen3_omni_lm.py)."""
    assert not any(hasattr(cls, f"phase_{p}") for p in phases)


def test_outputs_come_back_lazily_and_match_the_reference(family: Family) -> None:
    """Counts, flags and items are `Lazy` (background readbacks), the rest device views; two rows
    at different depths give each its own reference step."""
    lm, paged = family.lm, PagedKV(family.lm)
    a, b = encode(family, "a longer first prompt", "two")
    (out_a,) = paged.step("prefill", [{"tokens": a, "max_new": 9}], [("a", "main")])
    (out_b,) = paged.step("prefill", [{"tokens": b, "max_new": 9}], [("b", "main")])
    ref_a, ref_b = R.DenseKV(lm.layers), R.DenseKV(lm.layers)
    step_a, step_b = R.ref_prefill(lm, ref_a, a, 9), R.ref_prefill(lm, ref_b, b, 9)
    raw = _run(paged, [{"token": out_a["token"]}, {"token": out_b["token"]}], [("a", "main"), ("b", "main")])
    assert all(isinstance(row["done"], Lazy) and isinstance(row["code"], Lazy) for row in raw)
    assert all(isinstance(row["token"], torch.Tensor) and row["token"].shape == (1,) for row in raw)
    for row, ref in zip(raw, (R.ref_decode(lm, ref_a, step_a.token), R.ref_decode(lm, ref_b, step_b.token))):
        assert row["token"].tolist() == [ref.token] and row["done"].get() is ref.done
        assert row["code"].get().tolist() == ([] if ref.code is None else [ref.code])
        torch.testing.assert_close(row["hidden"], ref.hidden, atol=1e-5, rtol=1e-5)


def test_items_are_the_readback_s_host_copy(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """An item port's values come from their own background copy (on a GPU a host tensor, as a
    cohort's items are: a host consumer, a tokenizer, never waits), not from the step's output.
    On the CPU the copy is the output itself, so a stand-in copies it, and the test marks the copy."""
    copies: list[Readback] = []

    class Copied(Readback):
        def __init__(self, tensor: torch.Tensor):
            super().__init__(tensor.clone())
            copies.append(self)

    monkeypatch.setattr(column_call, "Readback", Copied)
    paged = PagedKV(family.lm)
    (ids,) = encode(family, "a prompt")
    (out,) = paged.step("prefill", [{"tokens": ids, "max_new": 9}], [("r", "main")])
    (row,) = _run(paged, [{"token": out["token"]}], [("r", "main")])
    (items,) = [c for c in copies if c.tensor().dtype == torch.int32]  # `code`; counts and flags are int64
    items.tensor()[0] = -7  # what the copy holds is what the row gets
    got = row["code"].get()
    assert got.tolist() == [-7] and got.dtype == torch.int32  # this reply's first decode gives a code


def test_errors_name_the_port(family: Family) -> None:
    paged = PagedKV(family.lm)
    (ids,) = encode(family, "prompt")
    (out,) = paged.step("prefill", [{"tokens": ids, "max_new": 4}], [("r", "main")])
    with pytest.raises(RequestError, match="never prefilled") as e:
        _run(paged, [{"token": out["token"]}], [("fresh", "main")])
    assert e.value.field == "token"
    with pytest.raises(RequestError, match="input 'token' is missing"):
        _run(paged, [{}], [("r", "main")])
    with pytest.raises(RequestError, match="input 'token' must be a tensor or a number, got str") as e:
        _run(paged, [{"token": "7"}], [("r", "main")])  # torch cannot stack it: before any join looks
    assert e.value.field == "token"
    paged.step("prefill", [{"tokens": ids, "max_new": 4}], [("s", "main")])
    with pytest.raises(RequestError, match="'token' of shapes"):
        _run(paged, [{"token": out["token"]}, {"token": torch.tensor([[1]], dtype=torch.int32)}],
             [("r", "main"), ("s", "main")])
    seq = SeqState(paged.blocks.seq_len(("r", "main")), 2, paged.states[("r", "main")])
    with pytest.raises(NodeError, match="an entry of 2 tokens, the column step adds 1"):
        family.lm.run("decode", [{"token": out["token"]}], AttentionContext([seq], None, torch.device("cpu")))


def _run(paged: PagedKV, batch: list[dict], keys: list[tuple[str, str]]) -> list[dict]:
    """`decode` through `KVNode.run` with PagedKV's attention, the outputs as the call returns them."""
    return paged.step("decode", batch, keys, resolve_outputs=False)


def test_a_block_kept_nowhere_needs_an_empty_own_context() -> None:
    """`attend_block` is the engine's `attend` over the read context and the entry's own
    context: the same as a cohort's (reads and the block) only while that context is empty."""
    phase = CohortPhase(join=lambda state, inputs: {}, step=lambda b: {}, leave=lambda state, cols, steps: None,
                        tokens=2, keep=False)
    cpu = torch.device("cpu")
    with pytest.raises(NodeError, match="an entry whose context holds 3 tokens"):
        run_columns("n", phase, [{}], AttentionContext([SeqState(3, 2, {}, (5,))], None, cpu, reads=("vlm@main",)))
    assert run_columns("n", phase, [{}], AttentionContext([SeqState(0, 2, {}, (5,))], None, cpu,
                                                          reads=("vlm@main",))) == [{}]


def _reading_phase() -> CohortPhase:
    """A column step that reads one context: its output is `attend_to` of its token as a query,
    and the read context's length per row."""

    def step(b: CohortStep) -> dict[str, torch.Tensor]:
        assert b.attend_to is not None
        q = b.inputs["token"].float().reshape(b.n, 1, 1)
        return {"read": b.attend_to(0, q, 0).reshape(b.n, 1), "length": b.read_lens[0]}

    return CohortPhase(join=lambda state, inputs: {}, step=step, leave=lambda state, cols, steps: None)


def test_a_reading_step_attends_through_the_context_and_refuses_an_empty_one() -> None:
    """A plain call's `attend_to(layer, q, j)` is the context's attention over its j-th read
    context (Whisper's cross-attention); an entry whose read context is empty is refused, as
    a cohort's join refuses the row, not given a zero attention."""
    calls: list[tuple] = []

    def read(layer: int, q: torch.Tensor, k: object, v: object, over: tuple[int, ...]) -> torch.Tensor:
        calls.append((layer, k, v, over))
        return q * 10

    def context(lens: list[int]) -> AttentionContext:
        seqs = [SeqState(3, 1, {}, read_lens=(n,)) for n in lens]
        return AttentionContext(seqs, None, torch.device("cpu"), reads=("src@main",), read_fn=read)

    batch = [{"token": torch.tensor([2], dtype=torch.int32)}, {"token": torch.tensor([5], dtype=torch.int32)}]
    out = run_columns("n", _reading_phase(), batch, context([4, 7]))
    assert [row["read"].tolist() for row in out] == [[20.0], [50.0]]
    assert [int(row["length"]) for row in out] == [4, 7]
    assert calls == [(0, None, None, (0,))]
    with pytest.raises(RequestError, match="node 'n' reads src@main, which is empty"):
        run_columns("n", _reading_phase(), batch, context([4, 0]))


@pytest.mark.parametrize("token", [torch.tensor([1.0]), torch.tensor([1, 2], dtype=torch.int32),
                                   torch.tensor([True]), 7])
def test_a_malformed_fed_token_is_the_request_s_error(family: Family, token: object) -> None:
    """A plain call's join sees the fed token (a cohort's does not): one integer id of shape [1]
    (ops.ports.fed_token, the check every decode's join makes), else a RequestError on it."""
    paged = PagedKV(family.lm)
    (ids,) = encode(family, "prompt")
    paged.step("prefill", [{"tokens": ids, "max_new": 4}], [("r", "main")])
    with pytest.raises(RequestError, match="token must be one integer token id of shape") as e:
        _run(paged, [{"token": token}], [("r", "main")])
    assert e.value.field == "token"
