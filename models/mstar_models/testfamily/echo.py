"""EchoLM: a KV node whose forward is negligible, for measuring the runtime's host time per step.

prefill(tokens: i32[T], max_new: int) / decode(token: i32[1]) -> (token: i32[1], done: bool).
The next token is (token + 1) % vocab, where the 1 is the output of one real attention call:
queries and keys are the token's embedding (a [vocab, head_dim] table, one layer, one KV head),
every value is the constant vector (1, 0, ...), so attention over any context returns (1, 0,
...) up to rounding and `round(out[0])` is exactly 1. So the KV path is exercised (every token's
K/V is written to the paged pool and attended over) while the token sequence is
deterministic, independent of the weights and the same in a cohort and in a plain batched call.

The module holds the `llama` arch's tensors (`mstarc.archs.llama`, which gives the node its KV
geometry and so its KV pool; the catalogue has no smaller decoder) at the tiniest sizes
(hidden = head_dim, e.g. 2; one layer); only `model.embed_tokens` is used.

Per-(request, tag) state in `attn.states[i]`, set by `prefill` (as in `TinyLM`):
  `gen_base`: KV length at which the tag had produced 0 tokens (start + T - 1 of the prefill),
  `max_new`:  the request's token budget since that prefill.
`done` is raised once the tag produced `max_new` tokens (its prefill's one included) or its
context holds `max_seq_len` tokens: a column compare (after a prefill, a host fact). `decode`
is written once, as a column step; a plain batched call runs it as a one-step cohort
(runtime/mstar_runtime/ops/column_call.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mstar_models.layers.decoder import DecoderNode
from mstar_models.testfamily.common import llama_sizes, seed_and_place_, setting, start_reply
from mstar_models.testfamily.lm import TinyLM, llama_model
from mstar_runtime.ops import node
from mstar_runtime.ops.cohort import Attend, CohortPhase, CohortStep, Columns
from mstar_runtime.ops.ports import fed_token, one_rank

DEFAULT_MAX_SEQ_LEN = 4096  # the compiler's default of the `max_seq_len` node setting


class EchoLM(DecoderNode):
    """prefill(tokens: i32[T], max_new: int) / decode(token: i32[1]) -> (token: i32[1], done: bool)."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        one_rank(spec, "EchoLM")
        self.vocab, self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim = llama_sizes(spec)
        if self.heads != 1 or self.kv_heads != 1 or self.hidden != self.head_dim:
            raise node.NodeError(f"node '{spec.name}' (EchoLM): needs heads = kv_heads = 1 and hidden = head_dim")
        self.max_seq_len = int(spec.settings.get("max_seq_len", DEFAULT_MAX_SEQ_LEN))
        self.model = llama_model(self.vocab, self.hidden, self.layers, 1, 1, self.head_dim,
                                 int(setting(spec, "intermediate")), 1e-6)
        seed_and_place_(self, spec)

    # ------------------------------------------------------------------ contract
    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: node.NodeSpec) -> node.SeqPlan:
        if phase in ("prefill", "decode"):  # the same ports and KV use as TinyLM's
            return TinyLM.kv_plan(phase, shapes, spec)
        raise node.NodeError(f"node '{spec.name}' (EchoLM) has no phase '{phase}'")

    def cohort_phase(self, phase: str) -> CohortPhase | None:
        """`decode`, written only as a column step (ops/cohort.py; `run` calls it through ops/column_call.py)."""
        if phase != "decode":
            return None
        return CohortPhase(join=self._cohort_join, step=self._cohort_step, leave=lambda state, cols, steps: None)

    def _cohort_join(self, state: dict, inputs: Mapping) -> Columns:
        if "gen_base" not in state:
            raise node.RequestError("decode on a KV context that was never prefilled", "token")
        fed_token(inputs)  # a plain call's entry: its fed token (a cohort's join sees none)
        dev = self.model.embed_tokens.weight.device
        return {"gen_base": torch.tensor(state["gen_base"], device=dev),
                "max_new": torch.tensor(state["max_new"], device=dev)}

    def _cohort_step(self, b: CohortStep) -> dict[str, torch.Tensor]:
        ids = b.inputs["token"].reshape(-1).long()
        tokens = self.next_tokens(ids, b.attend)
        kv_after = b.positions + 1
        done = (kv_after - b.cols["gen_base"] >= b.cols["max_new"]) | (kv_after >= self.max_seq_len)
        return {"token": tokens[:, None], "done": done}

    # ------------------------------------------------------------------ phases
    def phase_prefill(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        ids = [start_reply(entry, seq, self.vocab, self.max_seq_len, "max_seq_len")
               for entry, seq in zip(batch, attn.seqs, strict=True)]
        tokens = self.next_tokens(torch.cat(ids).long(), attn.attend)
        return self._outputs(attn.last_rows(tokens), attn)

    # ------------------------------------------------------------------ math
    def next_tokens(self, ids: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Packed token ids [N] (int64) -> the next token of each, int32 [N] (no position encoding)."""
        n = ids.shape[0]
        e = self.model.embed_tokens(ids).view(n, 1, self.head_dim)
        v = torch.zeros_like(e)
        v[..., 0] = 1.0
        out = attend(0, e, e, v)  # [N, 1, head_dim]: (1, 0, ...) whatever the context
        step = out[:, 0, 0].round().long()
        return ((ids + step) % self.vocab).to(torch.int32)

    def _outputs(self, tokens: torch.Tensor, attn: node.AttentionContext) -> node.Batch:
        out: node.Batch = []
        for i, seq in enumerate(attn.seqs):
            kv_after = seq.start + seq.q_len
            done = kv_after - seq.state["gen_base"] >= seq.state["max_new"] or kv_after >= self.max_seq_len
            out.append({"token": tokens[i : i + 1], "done": done})
        return out
