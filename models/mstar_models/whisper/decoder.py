"""Whisper's text decoder as a KV node with three contexts per request: `text`, `cross`, `probe`.

transformers' `WhisperDecoder` + `proj_out` (tied to `embed_tokens`): token embedding plus
learned positions (`embed_positions`, 448), pre-LN layers of causal self-attention (over the
request's `text` context), cross-attention (its own q/out projections, keys and values of
the encoder states in the request's `cross` context) and the GELU MLP, a final LayerNorm,
logits = h @ embed_tokens^T. Tensor names are the checkpoint's, under `model.decoder.`.

Phases (models/whisper/whisper.walk):

  listen(states) -> ()                          @cross: per layer, `encoder_attn.k_proj / v_proj`
                                                 of the 1500 encoder states, stored (`attn.write`)
                                                 once per window
  detect(language) -> (lang)                    @probe, reads @cross: `<|startoftranscript|>`
                                                 alone at position 0; `lang` is `language` when
                                                 it is a language token, else the language token
                                                 of highest logit (transformers' `detect_language`)
  prefill(head, lang, tail, timestamps, max_tokens, min_tokens, temperature, seed)
      -> (token, logprob, no_speech, done)      @text, reads @cross: the prompt head + lang + tail
                                                 (e.g. [sot] [en] [transcribe, notimestamps]), the
                                                 first generated token; `no_speech` the
                                                 probability of <|nospeech|> at the head's last
                                                 token, <|startoftranscript|> (transformers'
                                                 `WhisperNoSpeechDetection`)
  step(token) -> (token, logprob, done)         @text, reads @cross: one token

`logprob` is the picked token's log-probability under the processed scores below (before a
temperature divides them): what the long-form fallback averages (windows.py).

Decoding is transformers' `WhisperForConditionalGeneration.generate` for one window, as its
generation config sets it up (`whisper_scores`, scores.py, applied in its order): the begin
suppressions (`begin_suppress_tokens` at the first generated token), `suppress_tokens`
always, and with timestamps the timestamp rules of `WhisperTimeStampLogitsProcessor`
(no `<|notimestamps|>`; timestamps in pairs; never decreasing; the first token a timestamp
of at most `max_initial_timestamp` steps; a timestamp whenever the timestamps' total
probability beats every text token's). Then greedy (temperature 0) or a seeded draw
(`mstar_runtime.sampling`) among the `sample_top_k` best scores (transformers' default
top_k of 50 for a sampled decode). `<|endoftext|>` is suppressed while fewer than `min_tokens`
tokens were generated (transformers' `min_new_tokens`: benchmarks on random weights decode
a fixed count). `done` is raised at `<|endoftext|>`, after `max_tokens`
generated tokens, or when the sequence reaches the 448 target positions (transformers'
`max_length`); a decode after `done` (the runtime's speculative step) runs on clamped
positions and its results are thrown away.

`step` is written once, as a column step (`cohort_phase`): a decode cohort
runs it over its device-resident columns, and `run` runs it over a plain batch of entries as
a one-step cohort (runtime/mstar_runtime/ops/column_call.py; a row the cohort declines, the
plan without its cohort marks). `prefill` picks its first token from the per-entry host
state (`_next`). Every phase goes through one layer loop, `forward_hidden`, given the two
attentions (self over `text`, cross over the `cross` context it reads).

Per-(request, text) state: `begin` (the prompt's length), `timestamps`, `max_new`, `min_new`, `n` (tokens
generated), `sampling` (the `SamplingParams` that `read_sampling` gives), and device scalars
`last`, `penult`, `ts_max` (the last two generated tokens and the highest timestamp so far,
-1 for none), so no step reads the device; `done` is a `readback.Lazy` of the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers.attention import cross_plan
from mstar_models.layers.init import seeded_init_
from mstar_models.whisper.common import LN_EPS, Layer, Sizes
from mstar_models.whisper.scores import NEG_INF, Rules, whisper_scores
from mstar_models.whisper.tokens import layout_of
from mstar_runtime import sampling
from mstar_runtime.ops import node
from mstar_runtime.ops.cohort import Attend, AttendTo, CohortPhase, CohortStep, Columns
from mstar_runtime.ops.ports import fed_token, scalar
from mstar_runtime.ops.readback import Lazy, Readback, upload


def _int_list(spec: node.NodeSpec, name: str) -> list[int]:
    value = spec.config.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise node.NodeError(f"node '{spec.name}': the config value {name} must be a list of token ids, got {value!r}")
    return value


_STATE = ("last", "penult", "ts_max")  # device scalars of the state, columns as they are


class Decoder(node.KVNode):
    """The Whisper decoder node; see the module docstring for its phases and state."""

    checkpoint_prefix: ClassVar[str] = "model.decoder."

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.sizes = s = Sizes(spec, "vocab", "target_positions")
        self.vocab, self.max_text = s.extra["vocab"], s.extra["target_positions"]
        self.layout = layout_of(spec)
        if self.layout.vocab != self.vocab:
            raise node.NodeError(f"node '{spec.name}': the config's vocab {self.layout.vocab} is not the arch's "
                                 f"{self.vocab}")
        self.embed_tokens = nn.Embedding(self.vocab, s.hidden)
        self.embed_positions = nn.Embedding(self.max_text, s.hidden)
        self.layers = nn.ModuleList(Layer(s, cross=True) for _ in range(s.layers))
        self.layer_norm = nn.LayerNorm(s.hidden, eps=LN_EPS)
        for p in self.parameters():
            p.requires_grad_(False)
        seeded_init_(self, spec.name)
        self.to(device=spec.device, dtype=spec.dtype)
        initial = spec.config.get("max_initial_timestamp", 50)
        if initial is not None and (not isinstance(initial, int) or isinstance(initial, bool) or initial < 0):
            raise node.NodeError(f"node '{spec.name}': max_initial_timestamp must be an int >= 0, got {initial!r}")
        top_k = spec.config.get("sample_top_k", 0)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise node.NodeError(f"node '{spec.name}': sample_top_k must be an int >= 0, got {top_k!r}")
        # a sampled decode draws among the top_k best scores (a greedy one has top-k off)
        self.sampling_ports = sampling.SamplingPorts(temperature=sampling.REQUIRED, finite=True, fixed_top_k=top_k)
        self.rules = Rules(self.layout, _int_list(spec, "suppress_tokens"), _int_list(spec, "begin_suppress_tokens"),
                           initial, spec.device)

    @property
    def kv_geometry(self) -> node.KVGeometry:
        return node.KVGeometry(self.sizes.layers, self.sizes.heads, self.sizes.head_dim)

    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: node.NodeSpec) -> node.SeqPlan:
        if phase == "listen":
            return cross_plan(shapes)
        if phase == "detect" or phase == "step":
            return node.SeqPlan(q_len=1)
        if phase == "prefill":
            head, tail = tuple(shapes.get("head", ())), tuple(shapes.get("tail", ()))
            if len(head) != 1 or len(tail) != 1 or head[0] == 0:
                raise node.RequestError(f"head and tail must be 1-D token lists (head non-empty), got {head} and "
                                        f"{tail}", "prompt")
            return node.SeqPlan(q_len=head[0] + 1 + tail[0])
        raise node.NodeError(f"node '{spec.name}' (whisper.Decoder) has no phase '{phase}'")

    # ------------------------------------------------------------------ math
    def forward_hidden(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
                       attend_to: AttendTo) -> torch.Tensor:
        """Packed ids [N] at `positions` [N] -> final-normed hidden [N, hidden]; self-attention
        through `attend(layer, q, k, v)` over the call's own context, cross-attention through
        `attend_to(layer, q, 0)` over the `cross` context it reads: an `AttentionContext`'s
        methods on the generic path, a `CohortStep`'s in the column step (`_cohort_step`)."""
        pos = positions.clamp(max=self.max_text - 1)  # a speculative step past the end: thrown away
        h = self.embed_tokens(ids) + self.embed_positions(pos)
        n = h.shape[0]
        for i, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.qkv(layer.self_attn_layer_norm(h))
            h = h + layer.self_attn.out_proj(attend(i, q, k, v).reshape(n, -1))
            qc = layer.encoder_attn.q(layer.encoder_attn_layer_norm(h))
            h = h + layer.encoder_attn.out_proj(attend_to(i, qc, 0).reshape(n, -1))
            h = layer.mlp(h)
        return self.layer_norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab], computed in the weights' dtype as transformers' `proj_out` does."""
        return F.linear(hidden, self.embed_tokens.weight).float()

    # ------------------------------------------------------------------ step, a column step
    def cohort_phase(self, phase: str) -> CohortPhase | None:
        """`step`, written only as a column step (runtime/mstar_runtime/ops/cohort.py): a decode
        cohort runs it over its rows, `run` over a plain batch as a one-step cohort
        (runtime/mstar_runtime/ops/column_call.py); every other phase is a `phase_<name>` method.
        It scores and picks as prefill does its first token (`_next`), for every row at once and
        with no host value: the per-(request, text) state that prefill writes into
        `attn.states[i]` becomes device columns at join and goes back into the state at leave:

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
      (before `listen`) is refused by column_call, as by a cohort's join."""
        if phase != "step":
            return None
        return CohortPhase(join=self._cohort_join, step=self._cohort_step, leave=self._cohort_leave)

    def _cohort_join(self, state: dict[str, Any], inputs: Mapping[str, Any]) -> Columns:
        if "begin" not in state:
            raise node.RequestError("a decoder step on a text context that was never prefilled", "token")
        fed_token(inputs)  # a plain call's entry (a cohort's join sees no fed input)
        cols = sampling.sampling_row(state["sampling"], state["n"])  # host values: uploaded without a wait
        cols.update({k: state[k].reshape(()) for k in _STATE})
        cols.update(n=torch.tensor(state["n"]), timestamps=torch.tensor(state["timestamps"]),
                    min_new=torch.tensor(state["min_new"]), max_new=torch.tensor(state["max_new"]))
        return cols

    def _cohort_leave(self, state: dict[str, Any], cols: Columns, steps: int) -> None:
        state["n"] += steps  # the host count, as the generic path keeps it (the column is on the device)
        for k in _STATE:
            state[k] = cols[k]

    def _cohort_step(self, b: CohortStep) -> dict[str, torch.Tensor]:
        if b.attend_to is None:
            raise node.NodeError(f"node '{self.spec.name}': a cohort step of `step` needs its `cross` context "
                                 "(the engine gave no attend_to)")
        c = b.cols
        ids = b.inputs["token"].reshape(-1).to(torch.long)
        logits = self.logits(self.forward_hidden(ids, b.positions, b.attend, b.attend_to))
        scores = whisper_scores(logits, self.rules, c["n"], c["last"], c["penult"], c["ts_max"], c["timestamps"],
                                c["min_new"])
        tokens = sampling.sample_columns(scores, sampling.SamplingColumns.from_cohort(c))
        # the log-probability under the scores a sampled row drew from (its top-k kept), as `_next`;
        # a sampled row's top-k is the node's fixed one (a greedy row's is 0): one topk of that k
        # over all rows gives every sampled row's k-th score
        kept, top_k = scores, min(self.sampling_ports.fixed_top_k or 0, self.vocab)
        if top_k:
            kth = torch.where(c["top_k"] > 0, scores.topk(top_k, dim=-1).values[:, -1], NEG_INF)
            kept = scores.masked_fill(scores < kth[:, None], NEG_INF)
        logprob = F.log_softmax(kept.float(), dim=-1).gather(1, tokens[:, None])
        tb = self.layout.timestamp_begin
        new_max = torch.where(tokens >= tb, torch.maximum(c["ts_max"], tokens), c["ts_max"])
        c["penult"].copy_(c["last"])
        c["last"].copy_(tokens)
        c["ts_max"].copy_(new_max)
        c["n"].add_(1)
        c["step"].add_(1)
        # transformers' max_length: after this token the sequence fills the 448 positions
        done = (tokens == self.layout.eot) | (c["n"] >= c["max_new"]) | (b.positions + 2 >= self.max_text)
        return {"token": tokens.to(torch.int32)[:, None], "logprob": logprob, "done": done}

    # ------------------------------------------------------------------ phases
    def phase_listen(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        s = self.sizes
        for entry, seq in zip(batch, attn.seqs, strict=True):
            states = entry.get("states")
            if not isinstance(states, torch.Tensor) or states.dim() != 2 or states.shape[1] != s.hidden:
                got = tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__
                raise node.RequestError(f"states must be [frames, {s.hidden}], got {got}", "states")
            if seq.start:
                raise node.RequestError("the cross-attention context already holds a window's states", "states")
        x = torch.cat([entry["states"] for entry in batch]).to(device=self.embed_tokens.weight.device,
                                                               dtype=self.embed_tokens.weight.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.encoder_attn.kv(x)
            attn.write(i, k, v)
        return [{} for _ in batch]

    def _check_cross(self, attn: node.AttentionContext) -> None:
        for seq in attn.seqs:
            if not seq.read_lens or seq.read_lens[0] == 0:
                raise node.RequestError("a decoder step before the window's audio was encoded (its cross context "
                                        "is empty)")

    def phase_detect(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        self._check_cross(attn)
        lay = self.layout
        asked = []
        for entry, seq in zip(batch, attn.seqs, strict=True):
            if seq.start:
                raise node.RequestError("language detection runs once per window, on a fresh probe context", "language")
            lang = _token(entry, "language")
            if lang != -1 and not 0 <= lang - lay.first_language < lay.languages:
                raise node.RequestError(f"language must be a language token or -1 (detect), got {lang}", "language")
            asked.append(lang)
        dev = self.embed_tokens.weight.device
        ids = torch.full((len(batch),), lay.sot, dtype=torch.long, device=dev)
        logits = self.logits(self.forward_hidden(ids, attn.positions(), attn.attend, attn.attend_to))
        detected = logits.masked_fill(self.rules.languages[None, :], NEG_INF).argmax(dim=-1)
        wanted = upload(asked, torch.long, dev)
        lang = torch.where(wanted >= 0, wanted, detected).to(torch.int32)
        return [{"lang": lang[i : i + 1]} for i in range(len(batch))]

    def phase_prefill(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        self._check_cross(attn)
        dev = self.embed_tokens.weight.device
        pieces = []
        for entry, seq in zip(batch, attn.seqs, strict=True):
            if seq.start:
                raise node.RequestError("prefill on a text context that already holds tokens", "prompt")
            head, lang, tail = (_ids(entry, p, self.vocab) for p in ("head", "lang", "tail"))
            if lang.numel() != 1:
                raise node.RequestError(f"lang must be one token, got {lang.numel()}", "lang")
            # the language token is the probe's output (on the device), the rest the prompt node's
            prompt = torch.cat([head.to(dev), lang.to(dev), tail.to(dev)])
            if prompt.numel() != seq.q_len:
                raise node.NodeError(f"node '{self.spec.name}': a prompt of {prompt.numel()} tokens got "
                                     f"{seq.q_len} slots")
            if seq.q_len >= self.max_text:
                raise node.RequestError(f"the prompt of {seq.q_len} tokens leaves no room in the decoder's "
                                        f"{self.max_text} positions", "prompt")
            params = sampling.read_sampling(entry, self.sampling_ports)
            max_new = params.max_tokens
            min_new = scalar(entry, "min_tokens", int, 0)
            if not 0 <= min_new <= max_new:
                raise node.RequestError(f"min_tokens must lie in [0, max_tokens = {max_new}], got {min_new}",
                                        "min_tokens")
            timestamps = scalar(entry, "timestamps", bool)
            seq.state.update(begin=seq.q_len, timestamps=bool(timestamps), max_new=max_new, min_new=min_new, n=0,
                             sampling=params,
                             last=torch.full((), -1, dtype=torch.long, device=dev),
                             penult=torch.full((), -1, dtype=torch.long, device=dev),
                             ts_max=torch.full((), -1, dtype=torch.long, device=dev))
            pieces.append(prompt)
        ids = torch.cat(pieces).to(device=dev, dtype=torch.long)
        packed = self.forward_hidden(ids, attn.positions(), attn.attend, attn.attend_to)
        out = self._next(self.logits(attn.last_rows(packed)), attn)
        # transformers' WhisperNoSpeechDetection: the <|nospeech|> probability of the raw logits
        # at <|startoftranscript|> (the last token of the head)
        rows, at = [], 0
        for entry, seq in zip(batch, attn.seqs, strict=True):
            rows.append(at + entry["head"].numel() - 1)
            at += seq.q_len
        at_sot = self.logits(packed.index_select(0, upload(rows, torch.long, dev)))
        no_speech = at_sot.softmax(dim=-1)[:, self.layout.nospeech]
        for i, o in enumerate(out):
            o["no_speech"] = no_speech[i : i + 1]
        return out

    def _next(self, logits: torch.Tensor, attn: node.AttentionContext) -> node.Batch:
        """Score, pick and record prefill's first token per entry; `done` as a lazy flag of the
        picked tokens (a later token is the column step's, `_cohort_step`)."""
        states = attn.states
        dev = logits.device
        n = upload([st["n"] for st in states], torch.long, dev)
        last, penult, ts_max = (torch.stack([st[k] for st in states]) for k in ("last", "penult", "ts_max"))
        ts_on = upload([int(st["timestamps"]) for st in states], torch.long, dev).bool()
        min_new = upload([st["min_new"] for st in states], torch.long, dev) if any(st["min_new"] for st in states) \
            else None
        scores = whisper_scores(logits, self.rules, n, last, penult, ts_max, ts_on, min_new)
        params = [st["sampling"] for st in states]
        tokens = sampling.sample(scores, params, [None] * len(states), [st["n"] for st in states])
        # the picked token's log-probability under the scores (before any temperature), as
        # transformers' `_retrieve_avg_logprobs` takes it for the fallback's threshold
        # (a sampled row's over its top_k scores, the distribution it drew from)
        kept = scores
        k = [st["sampling"].top_k for st in states]
        if any(k):
            kth = torch.full((len(states),), NEG_INF, device=dev)
            for i in (i for i in range(len(states)) if k[i]):  # as transformers' TopKLogitsWarper
                kth[i] = scores[i].topk(min(k[i], self.vocab)).values[-1]
            kept = scores.masked_fill(scores < kth[:, None], NEG_INF)
        logprob = F.log_softmax(kept.float(), dim=-1).gather(1, tokens.long()[:, None])[:, 0]
        tb = self.layout.timestamp_begin
        new_max = torch.where(tokens >= tb, torch.maximum(ts_max, tokens), ts_max)
        for i, st in enumerate(states):
            st["penult"], st["last"], st["ts_max"] = last[i], tokens[i], new_max[i]
        back = Readback(tokens)
        tok32 = tokens.to(torch.int32)
        out: node.Batch = []
        for i, (st, seq) in enumerate(zip(states, attn.seqs, strict=True)):
            st["n"] += 1
            kv_after = seq.start + seq.q_len
            # transformers' max_length: the sequence (prompt + generated) fills the 448 positions
            limit = st["n"] >= st["max_new"] or kv_after + 1 >= self.max_text
            out.append({"token": tok32[i : i + 1], "logprob": logprob[i : i + 1],
                        "done": True if limit else Lazy(lambda i=i: back.values()[i] == self.layout.eot)})
        return out


def _token(entry: Mapping[str, Any], port: str) -> int:
    value = entry.get(port)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point:
            raise node.RequestError(f"{port} must be one integer token id", port)
        return int(value.reshape(()))
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise node.RequestError(f"{port} must be one integer token id, got {type(value).__name__}", port)


def _ids(entry: Mapping[str, Any], port: str, vocab: int) -> torch.Tensor:
    t = entry.get(port)
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise node.RequestError(f"{port} must be a 1-D tensor of integer token ids", port)
    if t.numel():
        lo, hi = t.aminmax()
        if int(lo) < 0 or int(hi) >= vocab:
            raise node.RequestError(f"{port} token ids must lie in [0, {vocab}), got [{int(lo)}, {int(hi)}]", port)
    return t.to(torch.long)
