"""Orpheus' Llama-3.2 backbone as a KV node: prefill/decode, seeded sampling, token -> SNAC code.

The math is Hugging Face's `LlamaForCausalLM` (transformers 5.x) step for step: RMSNorm in
float32 then cast back, llama3-scaled RoPE applied in the activation dtype (as HF does),
grouped-query attention through the runtime's paged context, SwiGLU, and a head tied to
the input embedding. Parameter names are the checkpoint's (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `model.norm.weight`; `lm_head.weight`
only when the head is untied), so `mstar_runtime.weights` loads a HF folder directly.

Tensor parallelism (the plan's `tp` for the node): each rank holds a shard under the same
names (q/k/v, gate/up by output features; o_proj, down_proj by input features, each
followed by an all-reduce; the embedding and the head by vocab rows, an all-reduce after
the lookup and an all-gather of the logits) and runs every step with the other ranks of
its group (`mstar_runtime.ops.tp`). Every rank ends with the same full logits, so each samples
the same token; the conductor takes rank 0's outputs. At tp 1 none of it runs.

Phases (models/orpheus/orpheus.walk, node `llm`):
  prefill(prompt, temperature, top_p, repetition_penalty, max_tokens, seed) -> (token, code, done)
  decode(token) -> (token, code, done)

Per-(request, tag) state in `attn.states[i]`, written by prefill (the sampling settings
are given once, as vLLM keeps SamplingParams with a sequence, so decode needs only the
last token):
  `sampling`:   the request's `SamplingParams` (temperature, top_p, repetition_penalty, seed,
                max_tokens), read by `mstar_runtime.sampling.read_sampling`
  `max_tokens`: tokens the request may generate in all (prefill's token counts as the first)
  `history`:    int64 [cap] on the device, the token id at each KV position (prompt, then
                every token fed back), -1 where unknown; the repetition penalty reads the
                prefix that is in the context, i.e. prompt + generated, as HF and vLLM do.
                None when the penalty is 1 (nothing would read it).
  `step`:       tokens sampled so far = the sampler step of the next draw, so a request's
                draws depend only on (seed, step), never on its batch or its timing
  `k`:          audio codes emitted so far (selects the code position k % 7 of the next one),
                an int64 0-d tensor on the device, so that no step waits to read a token

Token -> code (docs/models/orpheus.md, Facts): `code = T - 128266 - (k % 7) * 4096`; a token
gives one code item iff 0 <= code < 4096 (then k += 1), anything else (end_of_speech, a
text id, an audio id of the wrong position) gives zero items. The reference decoder also
drops code 0 (its check is `> 0`), which shifts its 7-position alignment for the rest of
the stream; we keep code 0, since it is a valid SNAC code.

`done` is raised on end_of_speech, when `max_tokens` tokens have been generated, or when
the context reaches the `max_seq_len` setting (the next decode would not fit; vLLM's
"length" finish). The runtime reads `done` one step late (speculative loop): a decode after
`done` may still run; it must not fail, and its results are thrown away.

`code` and `done` are `readback.Lazy` values (a prefill's `done` that a host limit raises is
a plain True): the step returns as soon as its kernels are queued, and the runtime resolves them
when the request's next step has been launched (docs/runtime.md, "No host waits").

Node settings: `max_seq_len` (default 4096, as the compiler's memory pass assumes);
`audio_only` (default false): mask the logits to the audio ids of the current code position
plus end_of_speech before sampling. For benchmarks with random (dummy) weights, which would
otherwise sample text ids that carry no code and starve the SNAC stream; with it every
generated token but end_of_speech is a valid code. Never set it for real checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from mstar_models.layers.decoder import Decoder, DecoderNode
from mstar_models.layers.embedding import LMHead, VocabEmbedding, lm_logits
from mstar_models.layers.init import seeded_init_
from mstar_models.layers.mlp import GatedMLP
from mstar_models.layers.rotary import llama3_inv_freq, rope_tables
from mstar_runtime import sampling
from mstar_runtime.kv.prefix_cache import token_keys
from mstar_runtime.ops import node, tp
from mstar_runtime.ops.cohort import CohortPhase, CohortStep, Columns
from mstar_runtime.ops.ports import config_value, fed_token, max_seq_len
from mstar_runtime.ops.readback import Lazy, Readback, upload_tensor

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# docs/models/orpheus.md, Facts; the walk's config normally supplies these.
TOKEN_DEFAULTS = {
    "audio_token_offset": 128266,
    "codebook_size": 4096,
    "end_of_speech": 128258,
    "frame_tokens": 7,
}

# the prefill's sampling ports (the walk gives every one; a seed it may leave out)
SAMPLING_PORTS = sampling.SamplingPorts(temperature=sampling.REQUIRED, top_p=sampling.REQUIRED,
                                        repetition_penalty=sampling.REQUIRED)


# ------------------------------------------------------------------------------- helpers
def _code_items(codes: torch.Tensor, code: int, i: int) -> torch.Tensor:
    """Entry i's `code` items on the host, a view of the step's codes: [code], or none when
    `code` is -1 (the token was not a code)."""
    return codes[i : i + 1] if code >= 0 else codes[i:i]


# ---------------------------------------------------------------------------------- node
class LlamaBackbone(DecoderNode):
    """The Orpheus LLM node; see the module docstring for its phases, state and settings."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        g = lambda name, *default: config_value(spec, name, *default, owner="LlamaBackbone")  # noqa: E731
        self.vocab, self.hidden, self.layers = int(g("vocab")), int(g("hidden")), int(g("layers"))
        self.heads, self.kv_heads, self.head_dim = int(g("heads")), int(g("kv_heads")), int(g("head_dim"))
        self.tied = bool(g("tie_embeddings", False))
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise node.NodeError(
                f"node '{spec.name}': heads ({self.heads}) must be a multiple of kv_heads "
                f"({self.kv_heads}) and head_dim ({self.head_dim}) even"
            )
        self.audio_offset = int(g("audio_token_offset", TOKEN_DEFAULTS["audio_token_offset"]))
        self.codebook = int(g("codebook_size", TOKEN_DEFAULTS["codebook_size"]))
        self.eos = int(g("end_of_speech", TOKEN_DEFAULTS["end_of_speech"]))
        self.frame_tokens = int(g("frame_tokens", TOKEN_DEFAULTS["frame_tokens"]))
        self.max_seq_len = max_seq_len(spec)
        self.audio_only = spec.settings.get("audio_only", False) is True
        if self.audio_only and self.audio_offset + self.frame_tokens * self.codebook > self.vocab:
            raise node.NodeError(f"node '{spec.name}': audio_only needs the audio ids below vocab {self.vocab}")
        intermediate = int(g("intermediate"))
        self._init_tp(spec, intermediate)

        # Built on the meta device and then given real (uninitialised) storage: a 3B model
        # must not pay for torch's default init only to be overwritten by the loader.
        # Under tensor parallelism the modules have this rank's sizes (the same names).
        self.eps = float(g("rms_eps", 1e-5))
        group, local_inter, factory = self.tp_group, intermediate // self.tp, {"dtype": spec.dtype}
        with torch.device("meta"):
            embed = VocabEmbedding(self.vocab // self.tp, self.hidden, self.vocab_start, group, **factory)
            self.model = Decoder(self.layers, self.hidden, self.local_heads, self.local_kv_heads, self.head_dim,
                                 self.eps, lambda i: GatedMLP(self.hidden, local_inter, group, **factory),
                                 group=group, embed=embed, **factory)
            if not self.tied:
                self.lm_head = LMHead(self.vocab // self.tp, self.hidden, group, self.tp, **factory)
        self.to_empty(device=spec.device)
        # HF's Llama init (N(0, 0.02) matrices, unit norm gains), seeded by the node name, so the
        # `init` weights source is deterministic; a sharded rank keeps its slice of each full
        # matrix: tp N holds the values of tp 1
        seeded_init_(self, spec.name, self.tp_layout.split_of)
        # float32 whatever the weights' dtype, computed on the CPU and then moved, as HF does (a
        # GPU pow can differ in the last bit); not persistent: the loader never looks for it
        inv_freq = llama3_inv_freq(self.head_dim, float(g("rope_theta", 500000.0)))
        self.register_buffer("inv_freq", inv_freq.to(spec.device), persistent=False)

    def _init_tp(self, spec: node.NodeSpec, intermediate: int) -> None:
        """This rank's share of the node (`tp.MegatronLayout`: q/k/v and gate/up by output
        features, o_proj and down_proj by input features, then an all-reduce; the embedding and
        the head, tied or not, by vocab rows; KV heads split or replicated)."""
        lay = tp.MegatronLayout.of(spec, "LlamaBackbone", self.heads, self.kv_heads, self.vocab,
                                   ("intermediate", intermediate))
        self.tp_layout = lay
        self.tp, self.tp_rank, self.tp_group = lay.tp, lay.rank, lay.group
        self.local_heads, self.local_kv_heads, self.vocab_start = lay.heads, lay.kv_heads, lay.vocab_start

    # ------------------------------------------------------------------ contract
    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: node.NodeSpec) -> node.SeqPlan:
        if phase == "prefill":
            shape = tuple(shapes["prompt"])
            if len(shape) != 1 or shape[0] < 1:
                raise node.RequestError(f"prompt must be a 1-D, non-empty token list, got shape {shape}", "prompt")
            limit = max_seq_len(spec)
            if shape[0] > limit:
                raise node.RequestError(
                    f"prompt of {shape[0]} tokens is longer than max_seq_len {limit}", "prompt"
                )
            return node.SeqPlan(q_len=shape[0])
        if phase == "decode":
            return node.SeqPlan(q_len=1)
        raise node.NodeError(f"node '{spec.name}' (LlamaBackbone) has no phase '{phase}'")

    @classmethod
    def prefix_content(cls, phase: str, inputs: Mapping[str, Any], spec: node.NodeSpec) -> list[int] | None:
        """A prefill's KV depends on its prompt's token ids (and what precedes them) only."""
        return token_keys(inputs.get("prompt")) if phase == "prefill" else None

    # ------------------------------------------------------------------ decode, a column step
    def cohort_phase(self, phase: str) -> CohortPhase | None:
        """`decode`, written only as a column step for decode cohorts (runtime/mstar_runtime/ops/cohort.py;
        a plain batched call runs it as a one-step cohort through runtime/mstar_runtime/ops/column_call.py);
        under TP every rank of the group runs it (its all-reduces and the gathered logits inside).

        Every row at once and with no host value: the per-request state a prefill leaves in
        `attn.states[i]` becomes device columns at join and goes back into the state at leave:

          sampling columns  temperature, top_k, top_p, penalty, greedy, seed, step (`sampling.SamplingColumns`)
          k                 audio codes emitted so far (the code position of the next one is k % 7)
          max_tokens        tokens the request may generate in all
          history           int64 [max_seq_len + 1]: the token at each KV position, -1 where unknown
                            (all -1 for a request without repetition penalty: nothing reads it then)

        Outputs per row: `token` [1], `code` [1] with `code:count` 0 or 1, `done`."""
        if phase != "decode":
            return None
        return CohortPhase(join=self._cohort_join, step=self._cohort_step, leave=self._cohort_leave,
                           max_items={"code": 1})

    def _cohort_join(self, state: dict[str, Any], inputs: Mapping[str, Any]) -> Columns:
        if "sampling" not in state:
            raise node.RequestError("decode on a KV context that was never prefilled", "token")
        fed_token(inputs)  # a plain call's entry: its fed token (a cohort's join sees none)
        cols = sampling.sampling_row(state["sampling"], state["step"])  # host values: uploaded without a wait
        hist = torch.full((self.max_seq_len + 1,), -1, dtype=torch.long, device=self.inv_freq.device)
        if state["history"] is not None:
            hist[: state["history"].numel()] = state["history"]
        cols.update(k=state["k"].reshape(()), max_tokens=torch.tensor(state["max_tokens"]), history=hist)
        return cols

    def _cohort_leave(self, state: dict[str, Any], cols: Columns, steps: int) -> None:
        state["step"] += steps
        state["k"] = cols["k"]
        if state["history"] is not None:
            state["history"].copy_(cols["history"][: state["history"].numel()])

    def _cohort_step(self, b: CohortStep) -> dict[str, torch.Tensor]:
        c = b.cols
        ids = b.inputs["token"].reshape(-1).to(torch.long)
        # the fed token at its KV position (a wasted decode after `done` may write past a row's
        # own history: its leave copies back only the part the request owns)
        c["history"].scatter_(1, b.positions.clamp(max=self.max_seq_len)[:, None], ids[:, None])
        logits = self.head(self.forward_hidden(ids, b.positions, b.attend))
        lo = self.audio_offset + (c["k"] % self.frame_tokens) * self.codebook
        if self.audio_only:
            vocab = torch.arange(logits.shape[1], device=logits.device)[None, :]
            allowed = ((vocab >= lo[:, None]) & (vocab < lo[:, None] + self.codebook)) | (vocab == self.eos)
            logits = logits.masked_fill(~allowed, float("-inf"))
        tokens = sampling.sample_columns(logits, sampling.SamplingColumns.from_cohort(c, history=c["history"]))
        codes = tokens - lo
        is_code = (codes >= 0) & (codes < self.codebook)
        c["k"].add_(is_code.long())
        c["step"].add_(1)
        kv_after = b.positions + 1
        done = (c["step"] >= c["max_tokens"]) | (kv_after >= self.max_seq_len) | (tokens == self.eos)
        return {"token": tokens.to(torch.int32)[:, None], "code": codes.to(torch.int32)[:, None],
                "code:count": is_code.long(), "done": done}

    # ------------------------------------------------------------------ phases
    def phase_prefill(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        # Validate every entry before touching any state: a RequestError makes the conductor
        # rerun the entries one by one, which must find them as they were.
        # a prefix found cached (`seq.cached` leading prompt tokens) is in the KV already: the
        # prompt is checked and remembered whole, its other tokens computed
        checked = [self._check_prefill(entry, seq.start - seq.cached, seq.q_len + seq.cached)
                   for entry, seq in zip(batch, attn.seqs)]
        device = self.inv_freq.device
        prompts = _upload_prompts([prompt for prompt, _, _ in checked], device)
        ks = torch.zeros(len(batch), dtype=torch.long, device=device).unbind(0)  # one fill for every entry's `k`
        for (_, params, max_tokens), prompt, k, seq in zip(checked, prompts, ks, attn.seqs, strict=True):
            seq.state.clear()
            seq.state.update(
                sampling=params,
                max_tokens=max_tokens,
                step=0,
                k=k,
                history=self._new_history(prompt, seq.start - seq.cached, max_tokens, params),
            )
        ids = torch.cat([prompt[seq.cached:] for prompt, seq in zip(prompts, attn.seqs)]).to(torch.long)
        hidden = attn.run_graphed(lambda i, p: self.forward_hidden(i, p, attn.attend), ids, attn.positions())
        return self._next_tokens(self.head(attn.last_rows(hidden)), attn)

    # ------------------------------------------------------------------ math
    def forward_hidden(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Packed token ids [N] at absolute `positions` [N] -> final-normed hidden states [N, hidden].

        Pure tensor code whose only attention is `attend` (so an engine may capture it in a CUDA
        graph): the layer library's decoder stack (`mstar_models.layers.decoder`, fused q/k/v and
        gate/up GEMMs, each residual add fused with the next norm). Under tensor parallelism the
        layers run the group's all-reduces, and every rank ends with the same hidden states."""
        h = self.model.embed_tokens(ids)
        # HF's LlamaRotaryEmbedding: angles in float32, cos/sin cast to the activation dtype
        cos, sin = rope_tables(positions, self.inv_freq, h.dtype)
        return self.model.forward_layers(h, cos, sin, attend)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] (computed in the weights' dtype, as HF does, then widened),
        the same full row on every rank of the TP group, so each samples the group's token."""
        if not self.tied:
            return self.lm_head(hidden)
        return lm_logits(hidden, self.model.embed_tokens.weight, self.tp_group, self.tp)

    # ------------------------------------------------------------------ sampling
    def _check_prefill(
        self, entry: Mapping[str, Any], start: int, q_len: int
    ) -> tuple[torch.Tensor, sampling.SamplingParams, int]:
        prompt = entry.get("prompt")
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or prompt.numel() == 0:
            raise node.RequestError("prompt must be a 1-D, non-empty tensor of token ids", "prompt")
        if prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise node.RequestError(f"prompt must hold integer token ids, got {prompt.dtype}", "prompt")
        if prompt.numel() != q_len:
            raise node.NodeError(
                f"node '{self.spec.name}': prefill of {prompt.numel()} tokens got {q_len} KV slots"
            )
        if start + q_len > self.max_seq_len:
            raise node.RequestError(
                f"prompt of {q_len} tokens (context {start + q_len}) is longer than "
                f"max_seq_len {self.max_seq_len}",
                "prompt",
            )
        # free for the prompt builder's host tensors; a device prompt costs one read per request
        lo, hi = prompt.aminmax()
        if int(lo) < 0 or int(hi) >= self.vocab:
            raise node.RequestError(
                f"prompt token ids must lie in [0, {self.vocab}), got [{int(lo)}, {int(hi)}]", "prompt"
            )
        params = sampling.read_sampling(entry, SAMPLING_PORTS)
        return prompt, params, params.max_tokens

    def _new_history(
        self, prompt: torch.Tensor, start: int, max_tokens: int, params: sampling.SamplingParams
    ) -> torch.Tensor | None:
        if params.repetition_penalty == 1.0:
            return None
        # Room for every position a sampled token can see: the last one is drawn with a
        # context of start + len(prompt) + max_tokens - 1 tokens, never more than max_seq_len.
        cap = min(start + prompt.numel() + max_tokens - 1, self.max_seq_len)
        hist = torch.full((cap,), -1, dtype=torch.long, device=prompt.device)
        hist[start : start + prompt.numel()] = prompt
        return hist

    def _next_tokens(self, logits: torch.Tensor, attn: node.AttentionContext) -> node.Batch:
        """Sample one token per entry (one sampler call for the batch) and map it to its code.

        Nothing here waits for the device: the code position `k` lives on the device, the
        sampled tokens and codes come back through one `Readback`, and `code` (a host tensor)
        and `done` are `Lazy` outputs resolved from it when the runtime needs them (one step
        late, see runtime/mstar_runtime/control/interpreter.py "lanes")."""
        states = attn.states
        kv_after = [s.start + s.q_len for s in attn.seqs]
        k = torch.stack([st["k"] for st in states])
        # the first id of the current code position's range, per entry
        lo = self.audio_offset + (k % self.frame_tokens) * self.codebook
        if self.audio_only:
            ids = torch.arange(logits.shape[1], device=logits.device)[None, :]
            allowed = ((ids >= lo[:, None]) & (ids < lo[:, None] + self.codebook)) | (ids == self.eos)
            logits = logits.masked_fill(~allowed, float("-inf"))
        histories = [
            None if st["history"] is None else st["history"][: min(kv, st["history"].numel())]
            for st, kv in zip(states, kv_after)
        ]
        tokens = sampling.sample(logits, [st["sampling"] for st in states], histories, [st["step"] for st in states])
        codes = tokens - lo
        is_code = (codes >= 0) & (codes < self.codebook)
        for st, k_next in zip(states, (k + is_code).unbind(0)):
            st["k"] = k_next
        # one background copy: the tokens (for `done`) and the codes (for `code`, as host
        # tensors: the SNAC consumer then checks and uploads them without a device wait)
        back = Readback(torch.stack([tokens, torch.where(is_code, codes, -1)]))
        tok32 = tokens.to(torch.int32)
        # the step's codes as one host int32 tensor, made on first use; each entry's items are a view
        codes_host = Lazy(lambda: torch.tensor(back.values()[1], dtype=torch.int32))
        out: node.Batch = []
        for i, (st, kv) in enumerate(zip(states, kv_after)):
            st["step"] += 1
            # the limits are host facts; only end_of_speech needs the sampled token
            limit = st["step"] >= st["max_tokens"] or kv >= self.max_seq_len
            out.append({
                "token": tok32[i : i + 1],
                "code": Lazy(lambda i=i: _code_items(codes_host.get(), back.values()[1][i], i)),
                "done": True if limit else Lazy(lambda i=i: back.values()[0][i] == self.eos),
            })
        return out


def _upload_prompts(prompts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The batch's prompts on `device`: host prompts of one dtype joined on the host and sent in
    one upload from pinned memory (each prompt a view of it), others one upload each."""
    if len(prompts) > 1 and all(p.device.type == "cpu" and p.dtype == prompts[0].dtype for p in prompts):
        return list(upload_tensor(torch.cat(prompts), device).split([p.numel() for p in prompts]))
    return [upload_tensor(p, device) for p in prompts]
