"""Qwen3-Omni's thinker as a KV node: the 48-layer MoE text model with its encoders' outputs, lm_head, sampling.

The math is transformers 5.24's `Qwen3OmniMoeThinkerForConditionalGeneration` step for step
(`layers.decoder.Decoder` with QK-norm and `layers.moe.SparseMoE` MLPs, interleaved MRoPE from
`positions.rope_index`, untied `lm_head`). Parameters carry the checkpoint's names under
`thinker.` (`thinker.model.embed_tokens.weight`, `thinker.model.layers.{i}.*`,
`thinker.model.norm.weight`, `thinker.lm_head.weight`).

Tensor parallelism (the plan's `tp` for the node, Megatron's layout as the compiler's shard-tp
pass cuts the checkpoint): each rank holds a shard under the same names: q/k/v by heads (KV
heads split, or, when tp is a multiple of them, the one its query heads read), o_proj by
input features; every expert's gate/up rows and down columns by `moe_intermediate`, the router
and the norms whole; the embedding and `lm_head` by vocab rows. The attention output, the MoE
output of each layer and the embedding lookup are all-reduced over the node's TP group and the
logits all-gathered (`mstar_runtime.ops.tp`), so every rank carries the same full residual
stream (the deepstack additions and the talker's tapped states are read from it) and samples
the same token from the same logits; the conductor keeps rank 0's outputs. At tp 1 none of it
runs (the collectives are no-ops).

Prefill (models/qwen3_omni/qwen3_omni.walk, node `thinker`):
- the token embeddings, with the audio encoder's rows (`audio` [Na, hidden]) put at the audio
  placeholder positions and the vision encoder's merged rows (`image` [Nv, hidden]) at the
  image placeholder positions, in order (HF's masked_scatter);
- positions from `rope_index` over the prompt with the image grids (`grid` [K, 3]); each
  audio's length is its placeholder count;
- deepstack: `deepstack` [D, Nv, hidden] row d is added to the output of layer d at the
  image positions (D <= layers);
- the next token is sampled from the last position's logits.
The layers run through `attn.run_graphed` over per-token rows (the embeddings, the positions,
and with images the deepstack rows and an image-row mask): with prefix caching the engine runs
them in the prefix chunks (runtime/mstar_runtime/engine/chunked.py), a hit as its miss.
Decode feeds one token at KV index j with position j + delta in all three components.
Every step returns `token` [1] (on the device, fed back to the next decode), `emitted` (the
same id as a host item for the text stream, a `readback.Lazy`) and `done`. `decode` and
`decode_speech` are written once, as column steps (`cohort_phase`, top-k sampling included):
a decode cohort runs them, and a plain batched call runs them as a one-step cohort
(runtime/mstar_runtime/ops/column_call.py; on a GPU through the phase's CUDA graphs). The
prefill's first token comes back as their outputs do (`_outputs`).

Speech phases also give what the talker reads (`talker.TalkerMoE`):
- at prefill, the talker's prompt (`_talker_prompt`; HF `generate`'s `_get_talker_user_parts`
  and `_get_talker_assistant_parts`): `states` [S, hidden], the rows of the talker prompt's
  text stream before the talker projects them, i.e. every position of the user turns (from
  a user turn's `<|im_start|>` up to the next `<|im_start|>`; system and earlier assistant
  turns are dropped), then the assistant header `<|im_start|>assistant\\n`, four `tts_pad`
  and one `tts_bos` embedding (S = user positions + 8); at text positions a row is the input
  embedding, at audio / image / video positions (`mm` [S]) the hidden state HF's
  `hidden_states` tuple holds at index `accept_hidden_layer` (0 = the input embeddings,
  i = the output of layer i - 1 before that layer's deepstack addition, `layers` = the
  final-normed output); `positions` [3, S], the talker's positions (`rope_index` over the
  user ids and nine `tts_pad`, the ninth being the talker's first decode). The prompt must
  end with the assistant header;
- `item` [1, hidden] at every step: the embedding of the token just sampled, or, on the step
  that ends the text (`<|im_end|>` or the token limit), the embedding of `tts_eos` instead:
  HF's talker never sees the last generated token (the thinker's returned hidden states stop
  before it) and gets `tts_eos` after the last one it does see.

Per-(request, tag) state (`attn.states[i]`), written by prefill: `sampling` (SamplingParams),
`max_tokens`, `step` (tokens sampled so far: the sampler step of the next draw), `delta`
(the MRoPE delta of the context). `done` is raised on `<|im_end|>`, at `max_tokens`, or when
the context reaches the `max_seq_len` setting; a decode's `done` and the prefill's
end-of-text check are `readback.Lazy`, so no step waits on the device. A decode after `done` (the runtime's
speculative step) runs and its results are thrown away.

Settings: `max_seq_len` (default 4096), `moe_kernel` (auto | grouped | padded | loop).
Config (walk config or `arch` arguments; released values by default): `experts_per_token`
(8), `norm_topk_prob` (true), `rope_theta` (1e6), `rms_eps` (1e-6), `mrope_section`
([24, 20, 20] at head_dim 128, `positions.default_mrope_section`), `accept_hidden_layer` (24),
and the token ids of `tokens.TokenIds`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mstar_models.layers.decoder import Decoder, DecoderNode
from mstar_models.layers.embedding import LMHead, VocabEmbedding
from mstar_models.layers.init import seeded_init_
from mstar_models.layers.moe import SparseMoE
from mstar_models.layers.rotary import inv_freq, mrope_tables
from mstar_models.qwen3_omni.lm_common import attention_sizes, grids, rows, token_ids
from mstar_models.qwen3_omni.positions import default_mrope_section, rope_index
from mstar_models.qwen3_omni.tokens import TokenIds
from mstar_runtime import sampling
from mstar_runtime.kv.prefix_cache import media_key, token_keys
from mstar_runtime.ops import node, tp
from mstar_runtime.ops.cohort import CohortPhase, CohortStep, Columns
from mstar_runtime.ops.column_call import rows_of
from mstar_runtime.ops.ports import config_value, fed_token, max_seq_len
from mstar_runtime.ops.readback import upload

PREFILLS = ("prefill", "prefill_speech")
DECODES = ("decode", "decode_speech")
# the prefills' sampling ports: top-k and top-p off unless given, no repetition penalty
SAMPLING_PORTS = sampling.SamplingPorts(temperature=sampling.REQUIRED, top_k=0, top_p=1.0)


@dataclass
class _Prompt:
    """One prefill entry, checked."""

    ids: torch.Tensor  # [T] long, on the device
    tokens: list[int]
    audio: torch.Tensor  # [Na, hidden]
    image: torch.Tensor  # [Nv, hidden]
    deepstack: torch.Tensor  # [D, Nv, hidden]
    positions: torch.Tensor  # [3, T] float32, from the context's start
    delta: float
    grids: list[tuple[int, int, int]]
    params: sampling.SamplingParams
    max_tokens: int


def _suffix(p: _Prompt, cached: int, tok: TokenIds) -> _Prompt:
    """The part of a checked prompt after its first `cached` tokens (whose KV was found cached):
    ids, positions, and the audio and image rows (and deepstack rows) of its placeholders."""
    head = p.tokens[:cached]
    a0, i0 = head.count(tok.audio_token_id), head.count(tok.image_token_id)
    return dataclasses.replace(p, ids=p.ids[cached:], tokens=p.tokens[cached:], audio=p.audio[a0:],
                               image=p.image[i0:], deepstack=p.deepstack[:, i0:], positions=p.positions[:, cached:])


def _clip_keys(keys: list[int], audio: torch.Tensor, placeholder: int) -> list[int]:
    """`keys` with each run of audio placeholders (one clip: a conversation's turns each have
    theirs) keyed by the `media_key` of that clip's rows, so a clip an earlier turn sent keys
    its positions as it did then. Rows that do not match the runs key every run by all of them."""
    runs: list[tuple[int, int]] = []
    for i, k in enumerate(keys):
        if k == placeholder:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
    if sum(b - a for a, b in runs) != audio.shape[0]:
        whole = media_key(audio)
        return [whole if k == placeholder else k for k in keys]
    out, row = list(keys), 0
    for a, b in runs:
        clip = media_key(audio[row:row + b - a])
        out[a:b] = [clip] * (b - a)
        row += b - a
    return out


class ThinkerMoE(DecoderNode):
    """The thinker node; see the module docstring for its phases, state and settings."""

    checkpoint_prefix: ClassVar[str] = "thinker."

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        sizes = attention_sizes(spec, "ThinkerMoE", sharded=True)
        self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim = sizes
        g = lambda name, *default: config_value(spec, name, *default)  # noqa: E731 - a local shorthand
        self.vocab = int(g("vocab"))
        experts, inter = int(g("experts")), int(g("moe_intermediate"))
        self._init_tp(spec, inter)
        self.section = [int(s) for s in g("mrope_section", default_mrope_section(self.head_dim))]
        if len(self.section) != 3 or sum(self.section) != self.head_dim // 2:
            raise node.NodeError(f"node '{spec.name}': mrope_section {self.section} must be 3 values summing to "
                                 f"head_dim / 2 = {self.head_dim // 2}")
        self.tap = int(g("accept_hidden_layer", 24))
        if not 0 <= self.tap <= self.layers:
            raise node.NodeError(f"node '{spec.name}': accept_hidden_layer {self.tap} is not in [0, {self.layers}]")
        self.tok = TokenIds.from_spec(spec)
        # the talker's 3-D positions follow the talker config's time scale (the same in the release)
        pps = config_value(spec, "talker_position_id_per_seconds", self.tok.position_id_per_seconds)
        self.talker_tok = dataclasses.replace(self.tok, position_id_per_seconds=pps)
        self.max_seq_len = max_seq_len(spec)
        eps = float(g("rms_eps", 1e-6))
        top_k, normalize = int(g("experts_per_token", 8)), bool(g("norm_topk_prob", True))
        kernel = str(spec.settings.get("moe_kernel", "auto"))
        factory: dict[str, Any] = {"dtype": spec.dtype, "device": spec.device}
        # this rank's shard under tensor parallelism (the same names; the whole model at tp 1)
        local_inter = inter // self.tp
        self.model = Decoder(
            self.layers, self.hidden, self.local_heads, self.local_kv_heads, self.head_dim, eps,
            lambda i: SparseMoE(self.hidden, experts, local_inter, top_k, normalize, kernel=kernel,
                                group=self.tp_group, **factory),
            qk_norm=True, group=self.tp_group, **factory,
        )
        self.model.embed_tokens = VocabEmbedding(self.local_vocab, self.hidden, self.vocab_start, self.tp_group,
                                                 **factory)
        self.lm_head = LMHead(self.local_vocab, self.hidden, self.tp_group, self.tp, **factory)
        seeded_init_(self, spec.name, self._split_of)
        # float32 on the CPU, then moved, as HF computes it; not persistent: never a checkpoint tensor
        self.register_buffer("freq", inv_freq(self.head_dim, float(g("rope_theta", 1e6))).to(spec.device),
                             persistent=False)
        self.attention_scale = self.head_dim**-0.5

    def _init_tp(self, spec: node.NodeSpec, inter: int) -> None:
        """This rank's share (`tp.MegatronLayout`: query and KV heads split, or KV heads
        replicated when tp is a multiple of them; every expert's intermediate features split;
        the embedding and the head by vocab rows; the router and the norms whole)."""
        lay = tp.MegatronLayout.of(spec, "ThinkerMoE", self.heads, self.kv_heads, self.vocab,
                                   ("moe_intermediate", inter))
        self.tp_layout = lay
        self.tp, self.tp_rank, self.tp_group = lay.tp, lay.rank, lay.group
        self.local_heads, self.local_kv_heads = lay.heads, lay.kv_heads
        self.local_vocab, self.vocab_start = lay.vocab, lay.vocab_start

    def _split_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, parts, part) of parameter `name` on this rank (None: whole)."""
        return self.tp_layout.split_of(name)

    # ------------------------------------------------------------------ contract
    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: node.NodeSpec) -> node.SeqPlan:
        if phase in PREFILLS:
            shape = tuple(shapes.get("ids", ()))
            if len(shape) != 1 or shape[0] < 1:
                raise node.RequestError(f"ids must be a 1-D, non-empty token list, got shape {shape}", "ids")
            if shape[0] > max_seq_len(spec):
                raise node.RequestError(f"prompt of {shape[0]} tokens is longer than max_seq_len {max_seq_len(spec)}",
                                        "ids")
            return node.SeqPlan(q_len=shape[0])
        if phase in DECODES:
            return node.SeqPlan(q_len=1)
        raise node.NodeError(f"node '{spec.name}' (ThinkerMoE) has no phase '{phase}'")

    @classmethod
    def prefix_content(cls, phase: str, inputs: Mapping[str, Any], spec: node.NodeSpec) -> list[int] | None:
        """A text prefill's KV depends on its ids, and at the audio and image placeholders on
        the rows put there (their bytes' `media_key`, each clip's apart; an image's also on its
        grids and deepstack rows). A speech prefill's keys stop before its first multimodal position:
        the talker's prompt takes the tapped hidden state there, which a cached block does not
        keep (so a conversation reuses its system prompt and the text before its first clip)."""
        keys = token_keys(inputs.get("ids")) if phase in PREFILLS else None
        if keys is None:
            return None
        tok = TokenIds.from_spec(spec)
        if phase == "prefill_speech":
            mm = set(tok.multimodal)
            return keys[: next((i for i, k in enumerate(keys) if k in mm), len(keys))]
        media: dict[int, int] = {}
        audio, image = inputs.get("audio"), inputs.get("image")
        if isinstance(audio, torch.Tensor) and audio.numel():
            keys = _clip_keys(keys, audio, tok.audio_token_id)
        if isinstance(image, torch.Tensor) and image.numel():
            grid, deep = inputs.get("grid"), inputs.get("deepstack")
            extra = [int(v) for v in grid.reshape(-1).tolist()] if isinstance(grid, torch.Tensor) else []
            if isinstance(deep, torch.Tensor) and deep.numel():
                extra.append(media_key(deep))
            media[tok.image_token_id] = media_key(image, *extra)
        return [media.get(k, k) for k in keys] if media else keys

    # ------------------------------------------------------------------ phases
    def phase_prefill(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        return self._prefill(batch, attn, speech=False)

    def phase_prefill_speech(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        return self._prefill(batch, attn, speech=True)

    # ------------------------------------------------------------------ math
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [N, hidden] (vocab-parallel under TP)."""
        return self.model.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab], the same full row on every rank of the TP group."""
        return self.lm_head(hidden)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of (t, h, w) positions [3, N]."""
        return mrope_tables(positions, self.freq, self.section, self.model.embed_tokens.weight.dtype)

    def forward_embeds(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        attn: node.AttentionContext,
        deepstack: torch.Tensor | None = None,
        at_image: torch.Tensor | None = None,
        tap: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Packed input rows h [N, hidden] at positions [3, N] -> final-normed hidden [N, hidden].

        `deepstack` [N, D, hidden]: row i's column d is added after layer d where `at_image` [N]
        (bool) is set (the sum index_add gives; a row of its own, so that the rows may be cut:
        `_prefill`); `tap` (a list) receives the hidden state at index `accept_hidden_layer` of
        HF's hidden_states tuple."""
        depth = 0 if deepstack is None else deepstack.shape[1]
        cos, sin = self.tables(positions)
        if tap is not None and self.tap == 0:
            tap.append(h)

        def after(i: int, x: torch.Tensor) -> torch.Tensor:
            if tap is not None and i + 1 == self.tap and self.tap < self.layers:
                tap.append(x)  # before this layer's deepstack addition, as HF records it
            if i < depth:
                assert deepstack is not None and at_image is not None
                x = torch.where(at_image[:, None], x + deepstack[:, i], x)
            return x

        out = self.model.forward_layers(h, cos, sin, attn.attend, after)
        if tap is not None and self.tap == self.layers:
            tap.append(out)
        return out

    # ------------------------------------------------------------------ prefill
    def _prefill(self, batch: node.Batch, attn: node.AttentionContext, speech: bool) -> node.Batch:
        # every entry is checked before any state changes: a RequestError makes the conductor
        # rerun the entries one by one, which must find them as they were
        # a prefix found cached (`seq.cached` leading tokens, text prefill only) is in the KV
        # already: the prompt is checked whole and only the rest of it is computed
        prompts = [self._check_prefill(entry, seq.start - seq.cached, seq.q_len + seq.cached, seq.state, speech)
                   for entry, seq in zip(batch, attn.seqs)]
        computed = [_suffix(p, seq.cached, self.tok) if seq.cached else p for p, seq in zip(prompts, attn.seqs)]
        dev = self.freq.device
        h = self.embed(torch.cat([p.ids for p in computed]))
        audio_at: list[int] = []
        image_at: list[int] = []
        offset = 0
        for p in computed:
            for i, t in enumerate(p.tokens):
                if t == self.tok.audio_token_id:
                    audio_at.append(offset + i)
                elif t == self.tok.image_token_id:
                    image_at.append(offset + i)
            offset += len(p.tokens)
        if audio_at:
            h = h.index_copy(0, upload(audio_at, torch.long, dev), torch.cat([p.audio for p in computed]))
        image_idx = upload(image_at, torch.long, dev) if image_at else None
        rows = [h, torch.cat([p.positions for p in computed], dim=1).to(dev).T]  # one row per token
        if image_idx is not None:
            h = rows[0] = h.index_copy(0, image_idx, torch.cat([p.image for p in computed]))
        depth = max(p.deepstack.shape[0] for p in computed) if image_idx is not None else 0
        if depth:
            assert image_idx is not None
            # an entry without images contributes no rows; one whose deepstack is shallower (or
            # absent) adds zeros at the layers it lacks
            parts = [torch.stack([p.deepstack[d] if d < p.deepstack.shape[0] else torch.zeros_like(p.image)
                                  for d in range(depth)], dim=1) for p in computed if p.image.shape[0]]
            deep = h.new_zeros(h.shape[0], depth, h.shape[1]).index_copy(0, image_idx, torch.cat(parts))
            rows += [deep, torch.zeros(h.shape[0], dtype=torch.bool, device=dev).index_fill(0, image_idx, True)]

        def layers(x: torch.Tensor, pos: torch.Tensor, *image: torch.Tensor) -> Any:
            tap: list[torch.Tensor] | None = [] if speech else None
            out = self.forward_embeds(x, pos.T, attn, *image, tap=tap)
            return out if tap is None else (out, tap[0])

        # through run_graphed, a row-wise function: with prefix caching its rows run in the
        # prefix chunks (runtime/mstar_runtime/engine/chunked.py), as a hit's and its miss's are
        hidden, tapped = attn.run_graphed(layers, *rows) if speech else (attn.run_graphed(layers, *rows), None)
        for p, seq in zip(prompts, attn.seqs, strict=True):
            seq.state.clear()
            # `step`: the sampler step of the next draw (the prefill's is 0)
            seq.state.update(sampling=p.params, max_tokens=p.max_tokens, step=1, delta=p.delta)
        out = self._first_tokens(self.logits(attn.last_rows(hidden)), prompts, attn, speech)
        if speech:
            assert tapped is not None
            for o, p, e, t, seq in zip(out, prompts, attn.split(h), attn.split(tapped), attn.seqs):
                if seq.cached:  # no multimodal position among them (prefix_content): embeddings only
                    e = torch.cat([self.embed(p.ids[: seq.cached]), e])
                    t = torch.cat([t.new_zeros(seq.cached, t.shape[1]), t])
                o.update(self._talker_prompt(p, e, t))
        return out

    def _check_prefill(
        self, entry: Mapping[str, Any], start: int, q_len: int, state: Mapping[str, Any], speech: bool
    ) -> _Prompt:
        ids = token_ids(entry, "ids", self.vocab)
        if ids.numel() != q_len:
            raise node.NodeError(f"node '{self.spec.name}': prefill of {ids.numel()} tokens got {q_len} KV slots")
        if start + q_len > self.max_seq_len:
            raise node.RequestError(f"prompt of {q_len} tokens (context {start + q_len}) is longer than max_seq_len "
                                    f"{self.max_seq_len}", "ids")
        tokens = ids.tolist()
        dev, dt, hid = self.freq.device, self.model.embed_tokens.weight.dtype, self.hidden
        audio, image = rows(entry, "audio", hid, dt, dev), rows(entry, "image", hid, dt, dev)
        tok = self.tok
        if tok.video_token_id in tokens:
            raise node.RequestError("video placeholders in the prompt, but this node takes no video input", "ids")
        n_audio, n_image = tokens.count(tok.audio_token_id), tokens.count(tok.image_token_id)
        if n_audio != audio.shape[0]:
            raise node.RequestError(f"the prompt has {n_audio} audio placeholders but the audio encoder gave "
                                    f"{audio.shape[0]} rows", "audio")
        if n_image != image.shape[0]:
            raise node.RequestError(f"the prompt has {n_image} image placeholders but the vision encoder gave "
                                    f"{image.shape[0]} rows", "image")
        image_grids = grids(entry, "grid")
        merged = sum(t * h * w // tok.vis_merge**2 for t, h, w in image_grids)
        if merged != n_image:
            raise node.RequestError(f"the image grids {image_grids} give {merged} merged patches; the prompt has "
                                    f"{n_image} image placeholders", "grid")
        deep = entry.get("deepstack")
        if not isinstance(deep, torch.Tensor) or deep.numel() == 0:
            deep = torch.zeros(0, n_image, hid, dtype=dt, device=dev)
        elif deep.dim() != 3 or deep.shape[1:] != (n_image, hid) or deep.shape[0] > self.layers:
            raise node.RequestError(f"deepstack must be [D <= {self.layers}, {n_image}, {hid}], got {list(deep.shape)}",
                                    "deepstack")
        positions, delta = rope_index(tokens, tok, image_grids)
        if start:  # a prompt that continues a context: its positions continue the context's
            if "delta" not in state:
                raise node.RequestError("a prefill that continues a context the thinker never prefilled", "ids")
            base = start + float(state["delta"])
            positions, delta = positions + base, delta + float(state["delta"])
        params = sampling.read_sampling(entry, SAMPLING_PORTS)
        max_tokens = params.max_tokens
        if speech:
            self._check_speech(tokens)
        return _Prompt(ids.to(device=dev, dtype=torch.long), tokens, audio, image, deep.to(device=dev, dtype=dt),
                       positions, delta, image_grids, params, max_tokens)

    def _check_speech(self, tokens: list[int]) -> None:
        tok, n = self.tok, len(tokens)
        if n < 3 or tokens[n - 3] != tok.im_start_token_id or tokens[n - 2] != tok.assistant_token_id:
            raise node.RequestError("a speech prompt must end with the assistant header <|im_start|>assistant\\n",
                                    "ids")
        for name in ("tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id"):
            if not 0 <= getattr(tok, name) < self.vocab:
                raise node.NodeError(f"node '{self.spec.name}': {name} {getattr(tok, name)} is outside the vocab "
                                     f"({self.vocab}); set it in the walk's config")

    def _talker_prompt(self, p: _Prompt, embeds: torch.Tensor, tapped: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the talker's prefill reads (HF `generate`'s `_get_talker_user_parts` / `_assistant_parts`).

        `states` [S, hidden]: the rows of the talker prompt's text stream before its projection:
        every position of the user turns (the span from `<|im_start|>` of a user turn up to the
        next `<|im_start|>`), as the input embedding or, at multimodal positions, the tapped
        hidden state; then the assistant header `<|im_start|>assistant\n`, four `tts_pad` and
        one `tts_bos` embedding (S = user positions + 8). `mm` [S] says which rows are tapped
        states. `positions` [3, S]: the talker's own positions, `rope_index` over the user ids
        followed by nine `tts_pad` (the ninth is its first decode step)."""
        tok, tokens = self.tok, p.tokens
        n = len(tokens)
        head = n - 3
        user: list[int] = []
        role_at = 0  # HF clamps "the last <|im_start|> so far" to position 0 before the first one
        for i, t in enumerate(tokens):
            if t == tok.im_start_token_id:
                role_at = i
            if tokens[min(role_at + 1, n - 1)] == tok.user_token_id:
                user.append(i)
        dev = embeds.device
        mm = torch.tensor([tokens[i] in tok.multimodal for i in user] + [False] * 8)
        at = upload(user, torch.long, dev)
        mm_user = mm[: len(user)].to(dev)[:, None]
        user_rows = torch.where(mm_user, tapped.index_select(0, at), embeds.index_select(0, at))
        extra = self.embed(upload([tok.tts_pad_token_id] * 4 + [tok.tts_bos_token_id], torch.long, dev))
        states = torch.cat([user_rows, embeds[head:], extra])
        talker_ids = [tokens[i] for i in user] + [tok.tts_pad_token_id] * 9
        positions, _ = rope_index(talker_ids, self.talker_tok, p.grids)
        return {"states": states, "mm": mm, "positions": positions[:, :-1].to(dev)}

    # ------------------------------------------------------------------ sampling
    def _first_tokens(self, logits: torch.Tensor, prompts: list[_Prompt], attn: node.AttentionContext,
                      speech: bool) -> node.Batch:
        """The prefill's first token per entry (one sampler call, at sampler step 0), its
        outputs as the decode's column step gives them (`_outputs`); `done` is True where a
        limit ends the reply at its first token (a host fact), else lazy (the end-of-text check)."""
        n = len(prompts)
        tokens = sampling.sample(logits, [p.params for p in prompts], [None] * n, [0] * n)
        limits = [p.max_tokens <= 1 or seq.start + seq.q_len >= self.max_seq_len
                  for p, seq in zip(prompts, attn.seqs, strict=True)]
        done = (tokens == self.tok.im_end_token_id) | upload(limits, torch.bool, tokens.device)
        out = rows_of(self._outputs(tokens, done, speech), n)
        for row, limit in zip(out, limits, strict=True):
            if limit:
                row["done"] = True
        return out

    def _outputs(self, tokens: torch.Tensor, done: torch.Tensor, speech: bool) -> dict[str, torch.Tensor]:
        """A step's outputs as columns from its sampled ids [n] (int64) and stop flags [n]: `token`
        (fed back), `emitted` (the text stream's item) and `done`; for speech also `item`, the
        talker's text item [n, 1, hidden]: the new token's embedding, or on the step that ends
        the text (`done`: <|im_end|> or a limit) tts_eos's (in the vocab: checked by the speech
        prefill). One embedding lookup (under TP split by vocab rows: one all-reduce)."""
        tok32 = tokens.to(torch.int32)[:, None]
        out = {"token": tok32, "emitted": tok32, "emitted:count": torch.ones_like(tokens), "done": done}
        if speech:
            out["item"] = self.embed(torch.where(done, self.tok.tts_eos_token_id, tokens))[:, None]
        return out

    def _step_logits(self, ids: torch.Tensor, positions: torch.Tensor, attend: Any) -> torch.Tensor:
        """Logits [B, vocab] of one text token per row at float positions [B] (equal in t, h, w)."""
        cos, sin = self.tables(positions[None, :].expand(3, -1))
        return self.logits(self.model.forward_layers(self.embed(ids), cos, sin, attend))

    # ------------------------------------------------------------------ cohort
    def cohort_phase(self, phase: str) -> CohortPhase | None:
        """`decode` and `decode_speech`, written only as column steps (runtime/mstar_runtime/ops/cohort.py):
        one token per row, the state as columns (the sampling settings and sampler step,
        `max_tokens`, the MRoPE `delta`); `decode_speech` also gives the talker's `item`. A
        plain batched call runs them as a one-step cohort (ops/column_call.py): the speech
        loop where no chained cohort runs it (its body also runs the talker: a chain,
        engine/cohort_chain.py) and a chat decode no cohort takes. At tp > 1 every rank of the group runs the step
        (`tp_dispatch.TPCohort`, or the plain call on every rank): the embedding's and layers'
        all-reduces and the gathered logits are inside it, so every rank samples the same token."""
        if phase not in DECODES:
            return None
        speech = phase == "decode_speech"
        return CohortPhase(join=self._cohort_join, step=lambda b: self._cohort_step(b, speech),
                           leave=self._cohort_leave, max_items={"emitted": 1})

    def _cohort_join(self, state: dict[str, Any], inputs: Mapping[str, Any]) -> Columns:
        if "sampling" not in state:
            raise node.RequestError("decode on a KV context that was never prefilled", "token")
        fed_token(inputs)  # a plain call's entry: its fed token (a cohort's join sees none)
        cols = sampling.sampling_row(state["sampling"], state["step"])
        cols.update(max_tokens=torch.tensor(state["max_tokens"]),
                    delta=torch.tensor(float(state["delta"]), dtype=torch.float32))
        return cols

    def _cohort_leave(self, state: dict[str, Any], cols: Columns, steps: int) -> None:
        state["step"] += steps

    def _cohort_step(self, b: CohortStep, speech: bool) -> dict[str, torch.Tensor]:
        c = b.cols
        ids = b.inputs["token"].reshape(-1).to(torch.long)
        logits = self._step_logits(ids, b.positions.to(torch.float32) + c["delta"], b.attend)
        # no repetition penalty in the thinker: the sampler skips that stage without a history
        tokens = sampling.sample_columns(logits, sampling.SamplingColumns.from_cohort(c))
        c["step"].add_(1)
        done = (c["step"] >= c["max_tokens"]) | (b.positions + 1 >= self.max_seq_len) | \
            (tokens == self.tok.im_end_token_id)
        return self._outputs(tokens, done, speech)
