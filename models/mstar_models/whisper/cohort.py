"""Whisper's decoder `step`, written once: a column step (runtime/mstar_runtime/ops/cohort.py).

A decode cohort runs it over its rows; `Decoder.run` runs it over a plain batch as a one-step
cohort (runtime/mstar_runtime/ops/column_call.py). It scores and picks as prefill does its
first token (`Decoder._next`), for every row at once and with no host value: the
per-(request, text) state that prefill writes into `attn.states[i]` becomes device columns
at join and goes back into the state at leave:

  sampling columns        temperature, top_k, top_p, penalty, greedy, seed, step
                          (`sampling.SamplingColumns`; `step` starts at `n`: the draw
                          of token n has step index n, as prefill's of token 0 has 0)
  n                       tokens generated so far
  last, penult, ts_max    the last two generated tokens and the highest timestamp (-1: none)
  timestamps              the timestamp rules on or off
  min_new, max_new        `<|endoftext|>` held back below min_new; done at max_new

Self-attention goes through `CohortStep.attend` (the row's `text` context), cross-attention
through `CohortStep.attend_to(layer, q, 0)` (its `cross` context, the phase's one `reads`),
in the decoder's own layer loop (`Decoder.forward_hidden`). Outputs per row: `token` [1],
`logprob` [1], `done`. Join refuses (RequestError naming `token`) a text context never
prefilled and, in a plain call (where it sees the entry's fed token), a token that is not
one integer id of shape [1]; its range is not read (it is this node's own output, on the
device: a host read would wait for the step before). A step whose `cross` context is empty
(before `listen`) is refused by column_call, as by a cohort's join.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from mstar_models.whisper.decoder import NEG_INF, whisper_scores
from mstar_runtime import sampling
from mstar_runtime.ops import node
from mstar_runtime.ops.cohort import CohortPhase, CohortStep, Columns
from mstar_runtime.ops.ports import fed_token

if TYPE_CHECKING:
    from mstar_models.whisper.decoder import Decoder

_STATE = ("last", "penult", "ts_max")  # device scalars of the state, columns as they are


def step_phase(decoder: Decoder) -> CohortPhase:
    tb, eot = decoder.layout.timestamp_begin, decoder.layout.eot
    # a sampled row's top-k is the node's fixed one (a greedy row's is 0): one topk of that k
    # over all rows gives every sampled row's k-th score
    top_k = min(decoder.sampling_ports.fixed_top_k or 0, decoder.vocab)

    def join(state: dict[str, Any], inputs: Mapping[str, Any]) -> Columns:
        if "begin" not in state:
            raise node.RequestError("a decoder step on a text context that was never prefilled", "token")
        fed_token(inputs)  # a plain call's entry (a cohort's join sees no fed input)
        cols = sampling.sampling_row(state["sampling"], state["n"])  # host values: uploaded without a wait
        cols.update({k: state[k].reshape(()) for k in _STATE})
        cols.update(n=torch.tensor(state["n"]), timestamps=torch.tensor(state["timestamps"]),
                    min_new=torch.tensor(state["min_new"]), max_new=torch.tensor(state["max_new"]))
        return cols

    def leave(state: dict[str, Any], cols: Columns, steps: int) -> None:
        state["n"] += steps  # the host count, as the generic path keeps it (the column is on the device)
        for k in _STATE:
            state[k] = cols[k]

    def step(b: CohortStep) -> dict[str, torch.Tensor]:
        if b.attend_to is None:
            raise node.NodeError(f"node '{decoder.spec.name}': a cohort step of `step` needs its `cross` context "
                                 "(the engine gave no attend_to)")
        c = b.cols
        ids = b.inputs["token"].reshape(-1).to(torch.long)
        logits = decoder.logits(decoder.forward_hidden(ids, b.positions, b.attend, b.attend_to))
        scores = whisper_scores(logits, decoder.rules, c["n"], c["last"], c["penult"], c["ts_max"], c["timestamps"],
                                c["min_new"])
        tokens = sampling.sample_columns(scores, sampling.SamplingColumns.from_cohort(c))
        # the log-probability under the scores a sampled row drew from (its top-k kept), as `_next`
        kept = scores
        if top_k:
            kth = torch.where(c["top_k"] > 0, scores.topk(top_k, dim=-1).values[:, -1], NEG_INF)
            kept = scores.masked_fill(scores < kth[:, None], NEG_INF)
        logprob = F.log_softmax(kept.float(), dim=-1).gather(1, tokens[:, None])
        new_max = torch.where(tokens >= tb, torch.maximum(c["ts_max"], tokens), c["ts_max"])
        c["penult"].copy_(c["last"])
        c["last"].copy_(tokens)
        c["ts_max"].copy_(new_max)
        c["n"].add_(1)
        c["step"].add_(1)
        # transformers' max_length: after this token the sequence fills the 448 positions
        done = (tokens == eot) | (c["n"] >= c["max_new"]) | (b.positions + 2 >= decoder.max_text)
        return {"token": tokens.to(torch.int32)[:, None], "logprob": logprob, "done": done}

    return CohortPhase(join=join, step=step, leave=leave)
