"""Orpheus' `decode` as a column step for decode cohorts (runtime/mstar_runtime/ops/cohort.py).

Orpheus' only decode: a plain batched call (`KVNode.run`) runs it as a one-step cohort
(runtime/mstar_runtime/ops/column_call.py). Every row at once and with no host value: the
per-request state a prefill leaves in `attn.states[i]` (its
`SamplingParams`, `step`, `k`, `max_tokens`, `history`) becomes device columns at join and
goes back into the state at leave:

  sampling columns  temperature, top_k, top_p, penalty, greedy, seed, step (`sampling.SamplingColumns`)
  k                 audio codes emitted so far (the code position of the next one is k % 7)
  max_tokens        tokens the request may generate in all
  history           int64 [max_seq_len + 1]: the token at each KV position, -1 where unknown
                    (all -1 for a request without repetition penalty: nothing reads it then)

Outputs per row: `token` [1], `code` [1] with `code:count` 0 or 1, `done`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from mstar_runtime import sampling
from mstar_runtime.ops import node
from mstar_runtime.ops.cohort import CohortPhase, CohortStep, Columns
from mstar_runtime.ops.ports import fed_token

if TYPE_CHECKING:
    from mstar_models.orpheus.backbone import LlamaBackbone


def decode_phase(backbone: LlamaBackbone) -> CohortPhase:
    width = backbone.max_seq_len + 1
    device = backbone.inv_freq.device

    def join(state: dict[str, Any], inputs: Mapping[str, Any]) -> Columns:
        if "sampling" not in state:
            raise node.RequestError("decode on a KV context that was never prefilled", "token")
        fed_token(inputs)  # a plain call's entry: its fed token (a cohort's join sees none)
        cols = sampling.sampling_row(state["sampling"], state["step"])  # host values: uploaded without a wait
        hist = torch.full((width,), -1, dtype=torch.long, device=device)
        if state["history"] is not None:
            hist[: state["history"].numel()] = state["history"]
        cols.update(k=state["k"].reshape(()), max_tokens=torch.tensor(state["max_tokens"]), history=hist)
        return cols

    def leave(state: dict[str, Any], cols: Columns, steps: int) -> None:
        state["step"] += steps
        state["k"] = cols["k"]
        if state["history"] is not None:
            state["history"].copy_(cols["history"][: state["history"].numel()])

    def step(b: CohortStep) -> dict[str, torch.Tensor]:
        c = b.cols
        ids = b.inputs["token"].reshape(-1).to(torch.long)
        # the fed token at its KV position (a wasted decode after `done` may write past a row's
        # own history: its leave copies back only the part the request owns)
        c["history"].scatter_(1, b.positions.clamp(max=width - 1)[:, None], ids[:, None])
        logits = backbone.head(backbone.forward_hidden(ids, b.positions, b.attend))
        lo = backbone.audio_offset + (c["k"] % backbone.frame_tokens) * backbone.codebook
        if backbone.audio_only:
            vocab = torch.arange(logits.shape[1], device=logits.device)[None, :]
            allowed = ((vocab >= lo[:, None]) & (vocab < lo[:, None] + backbone.codebook)) | (vocab == backbone.eos)
            logits = logits.masked_fill(~allowed, float("-inf"))
        tokens = sampling.sample_columns(logits, sampling.SamplingColumns.from_cohort(c, history=c["history"]))
        codes = tokens - lo
        is_code = (codes >= 0) & (codes < backbone.codebook)
        c["k"].add_(is_code.long())
        c["step"].add_(1)
        kv_after = b.positions + 1
        done = (c["step"] >= c["max_tokens"]) | (kv_after >= backbone.max_seq_len) | (tokens == backbone.eos)
        return {"token": tokens.to(torch.int32)[:, None], "code": codes.to(torch.int32)[:, None],
                "code:count": is_code.long(), "done": done}

    return CohortPhase(join=join, step=step, leave=leave, max_items={"code": 1})
