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
generation config sets it up (`whisper_scores`, applied in its order): the begin
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

`step` is written once, as the column step of cohort.py (`cohort_phase`): a decode cohort
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

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers.attention import cross_plan
from mstar_models.layers.init import seeded_init_
from mstar_models.whisper.common import LN_EPS, Layer, Sizes
from mstar_models.whisper.tokens import Layout, layout_of
from mstar_runtime import sampling
from mstar_runtime.ops import node
from mstar_runtime.ops.cohort import Attend, AttendTo, CohortPhase
from mstar_runtime.ops.ports import scalar
from mstar_runtime.ops.readback import Lazy, Readback, upload

NEG_INF = float("-inf")


def _int_list(spec: node.NodeSpec, name: str) -> list[int]:
    value = spec.config.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise node.NodeError(f"node '{spec.name}': the config value {name} must be a list of token ids, got {value!r}")
    return value


class Rules:
    """The generation config's token rules as device masks; `whisper_scores` applies them."""

    def __init__(self, layout: Layout, suppress: Sequence[int], begin_suppress: Sequence[int],
                 max_initial_timestamp: int | None, device: torch.device):
        self.layout = layout
        v = layout.vocab
        for t in (*suppress, *begin_suppress):
            if not 0 <= t < v:
                raise node.NodeError(f"suppressed token {t} is outside the vocabulary of {v}")
        self.suppress = torch.zeros(v, dtype=torch.bool, device=device)
        self.suppress[list(suppress)] = True
        self.begin = torch.zeros(v, dtype=torch.bool, device=device)
        self.begin[list(begin_suppress)] = True
        self.max_initial = max_initial_timestamp
        self.vocab_ids = torch.arange(v, device=device)
        self.languages = torch.ones(v, dtype=torch.bool, device=device)
        self.languages[layout.first_language : layout.first_language + layout.languages] = False


def whisper_scores(logits: torch.Tensor, rules: Rules, n: torch.Tensor, last: torch.Tensor, penult: torch.Tensor,
                   ts_max: torch.Tensor, timestamps: torch.Tensor, min_new: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 logits [B, V] -> the scores greedy decoding takes the argmax of (see the module
    docstring). Per row: `n` tokens generated so far, the `last` and `penult` of them (any value
    when there are fewer), the highest timestamp `ts_max` (-1: none), `timestamps` on or off,
    and `min_new`, the tokens before which `<|endoftext|>` is suppressed (transformers'
    `MinNewTokensLengthLogitsProcessor`, which runs before the others). Pure tensor code (no
    host read, no per-row Python)."""
    lay = rules.layout
    tb, ids = lay.timestamp_begin, rules.vocab_ids[None, :]
    first = (n == 0)[:, None]
    s = logits
    if min_new is not None:
        s = s.masked_fill((n < min_new)[:, None] & (ids == lay.eot), NEG_INF)
    s = s.masked_fill(first & rules.begin[None, :], NEG_INF)
    s = s.masked_fill(rules.suppress[None, :], NEG_INF)
    # the timestamp rules, for the rows that want timestamps
    t = s.clone()
    t[:, lay.notimestamps] = NEG_INF
    last_ts = ((n >= 1) & (last >= tb))[:, None]
    pen_ts = ((n < 2) | (penult >= tb))[:, None]
    is_ts = ids >= tb
    t = t.masked_fill(last_ts & pen_ts & is_ts, NEG_INF)  # a pair just closed: text (or eot) next
    t = t.masked_fill(last_ts & ~pen_ts & (ids < lay.eot), NEG_INF)  # an open timestamp: no text
    # never below the last timestamp (nor equal to it, unless it closes the pair it opened)
    floor = torch.where(ts_max < 0, torch.full_like(ts_max, tb),
                        torch.where((last_ts & ~pen_ts)[:, 0], ts_max, ts_max + 1))
    t = t.masked_fill(is_ts & (ids < floor[:, None]), NEG_INF)
    t = t.masked_fill(first & ~is_ts, NEG_INF)  # the first token is a timestamp ...
    if rules.max_initial is not None:  # ... of at most max_initial_timestamp steps
        t = t.masked_fill(first & (ids > tb + rules.max_initial), NEG_INF)
    logprobs = F.log_softmax(t.float(), dim=-1)
    ts_mass = logprobs[:, tb:].logsumexp(dim=-1)
    best_text = logprobs[:, :tb].max(dim=-1).values
    t = t.masked_fill((ts_mass > best_text)[:, None] & ~is_ts, NEG_INF)
    return torch.where(timestamps[:, None], t, s)


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
        methods on the generic path, a `CohortStep`'s in the cohort's column step (cohort.py)."""
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

    def cohort_phase(self, phase: str) -> CohortPhase | None:
        """`step`, written only as a column step (cohort.py; `run` calls it through
        ops/column_call.py); every other phase is a `phase_<name>` method."""
        if phase != "step":
            return None
        from mstar_models.whisper.cohort import step_phase  # cohort.py imports this module

        return step_phase(self)

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
        picked tokens (a later token is the column step's, cohort.py)."""
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
