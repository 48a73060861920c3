"""Encoder-decoder ASR nodes in Whisper's layout, for audio streamed in chunks.

Encoder: a chunk of N samples becomes F = ceil(N / frame) frames (the last zero-padded);
`frame` is 20 ms at 16 kHz (320 samples, Whisper's encoder frame rate of 50 per second) or a
quarter of the stream's `chunk_samples`, whichever is shorter, so that a tiny chunk still
has several frames. A learned filterbank (`frontend`, `mel_bins` filters of one frame each,
the implementation argument) gives per-frame log energies, `proj_in` maps them to the model
width, the arch's one-row `model.embed_tokens` is added to every frame, and the `llama`
layers attend bidirectionally within the chunk (RoPE positions 0 .. F - 1) before the final
norm. Chunks are encoded independently. The arch's one-row `lm_head` has no use in the
encoder; it is held so that a checkpoint in the arch's layout loads.

Decoder (tags `text`, `cross`): `listen(states)` @cross appends the frames' cross-attention
K/V (`model.layers.{i}.encoder_attn.k_proj / v_proj` of the states, no RoPE) to the cross
context, layer by layer, with `attn.write`. `step()` @text feeds the token the previous
step produced (the start token, vocab - 1, first) and, per layer: causal self-attention over
@text (RoPE), cross-attention over @cross (`attn.attend_to`, Whisper's pre-norm
`encoder_attn_layer_norm` and its own q/o projections), the SwiGLU MLP. It returns the
greedy next token and `done`, the decoder waits for more audio: it wrote the end-of-text
token (vocab - 2), or as many tokens as one per `FRAMES_PER_TOKEN` frames heard so far (an
emission policy that keeps the transcript behind the audio, as a streaming decoder must),
or the text context holds max_seq_len tokens. The tokens live in the @text state by
position, so a speculative step the runtime throws away changes nothing the next step reads.
A step past max_seq_len + 1 tokens (one speculative step beyond the bound) is a RequestError.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from mstar_models.layers.attention import Attention, cross_plan
from mstar_models.layers.decoder import DecoderNode
from mstar_models.layers.linear import Weight
from mstar_models.layers.norm import RMSNorm
from mstar_models.testfamily.common import llama_sizes, seed_and_place_, setting
from mstar_models.testfamily.lm import apply_rope, llama_model, rope_tables
from mstar_runtime.ops import node
from mstar_runtime.ops.ports import one_rank

ROPE_THETA = 10000.0
RMS_EPS = 1e-5
WHISPER_FRAME = 320  # samples of one encoder frame at 16 kHz (20 ms)
FRAMES_PER_TOKEN = 2  # the decoder writes at most one token per this many frames heard


def frame_samples(spec: node.NodeSpec) -> int:
    chunk = spec.config.get("chunk_samples")
    return max(1, min(WHISPER_FRAME, int(chunk) // 4)) if isinstance(chunk, int) else WHISPER_FRAME


class _Sizes:
    """The `llama` arch's sizes of a node."""

    def __init__(self, spec: node.NodeSpec):
        one_rank(spec)
        self.vocab, self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim = llama_sizes(spec)
        self.intermediate = int(setting(spec, "intermediate"))
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise node.NodeError(f"node '{spec.name}': heads must be a multiple of kv_heads, head_dim even")


class Encoder(node.StatelessNode):
    """encode(samples: f32[N]) -> (states: [F, hidden]) for one chunk of audio."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.sizes = s = _Sizes(spec)
        mel_bins = spec.settings.get("mel_bins")
        if not isinstance(mel_bins, int) or isinstance(mel_bins, bool) or mel_bins < 1:
            raise node.NodeError(f"node '{spec.name}': mel_bins must be a positive int, got {mel_bins!r}")
        self.frame = frame_samples(spec)
        self.frontend = nn.Conv1d(1, mel_bins, self.frame, stride=self.frame, bias=False)
        self.proj_in = nn.Linear(mel_bins, s.hidden)
        self.model = llama_model(s.vocab, s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate,
                                 RMS_EPS)
        self.lm_head = Weight.empty(s.vocab, s.hidden)
        seed_and_place_(self, spec)

    def quantize_weights(self, fmt: str) -> None:
        """`weights: fp8` (the loader, after filling): the stack's projections, as a DecoderNode's."""
        if fmt != "fp8":
            raise ValueError(f"node '{self.spec.name}': no weights format '{fmt}' (known: fp8)")
        self.model.quantize_fp8_()

    def frames_of(self, n: int) -> int:
        return -(-n // self.frame)

    def phase_encode(self, batch: node.Batch) -> node.Batch:
        for entry in batch:
            if entry["samples"].dim() != 1:
                raise node.RequestError(f"samples must be 1-D, got shape {tuple(entry['samples'].shape)}", "samples")
        out: list[torch.Tensor | None] = [None] * len(batch)
        groups: dict[int, list[int]] = {}
        for i, entry in enumerate(batch):  # chunks of one length are encoded together
            groups.setdefault(self.frames_of(entry["samples"].shape[0]), []).append(i)
        for n_frames, idx in groups.items():
            if n_frames == 0:
                for i in idx:
                    out[i] = torch.zeros(0, self.sizes.hidden, dtype=self.spec.dtype, device=self.spec.device)
                continue
            x = torch.zeros(len(idx), n_frames * self.frame, dtype=self.spec.dtype, device=self.spec.device)
            for row, i in enumerate(idx):
                samples = batch[i]["samples"]
                x[row, : samples.shape[0]] = samples.to(x)
            for row, states in zip(idx, self.encode(x).unbind(0)):
                out[row] = states
        return [{"states": states} for states in out]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Samples [B, F * frame] -> states [B, F, hidden]."""
        s = self.sizes
        energies = torch.log1p(self.frontend(x[:, None, :]).square()).transpose(1, 2)  # [B, F, mel_bins]
        h = self.proj_in(energies) + self.model.embed_tokens.weight[0]
        b, f, _ = h.shape
        cos, sin = rope_tables(torch.arange(f, device=h.device), s.head_dim, ROPE_THETA)
        for layer in self.model.layers:
            a = layer.self_attn
            x_ = layer.input_layernorm(h)
            q = apply_rope(a.q_proj(x_).view(b, f, s.heads, s.head_dim), cos, sin)
            k = apply_rope(a.k_proj(x_).view(b, f, s.kv_heads, s.head_dim), cos, sin)
            v = a.v_proj(x_).view(b, f, s.kv_heads, s.head_dim)
            group = s.heads // s.kv_heads
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2),
                v.repeat_interleave(group, 2).transpose(1, 2),
            ).transpose(1, 2)
            h = h + a.o_proj(att.reshape(b, f, s.heads * s.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h)


class Decoder(DecoderNode):
    """listen(states: [F, hidden]) -> () @cross; step() -> (token: i32[1], done: bool) @text,
    reading @cross."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        self.sizes = s = _Sizes(spec)
        self.max_text = int(spec.settings.get("max_seq_len", 0)) or None
        self.sot, self.eot = s.vocab - 1, s.vocab - 2
        self.model = llama_model(s.vocab, s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate,
                                 RMS_EPS)
        for layer in self.model.layers:  # Whisper's cross-attention block, beside each self-attention
            layer.encoder_attn = Attention(s.hidden, s.heads, s.kv_heads, s.head_dim)
            layer.encoder_attn_layer_norm = RMSNorm(s.hidden, RMS_EPS)
        self.lm_head = Weight.empty(s.vocab, s.hidden)
        seed_and_place_(self, spec)

    @classmethod
    def kv_plan(cls, phase: str, shapes: Mapping[str, tuple[int, ...]], spec: node.NodeSpec) -> node.SeqPlan:
        if phase == "listen":
            return cross_plan(shapes)
        if phase == "step":
            return node.SeqPlan(q_len=1)
        raise node.NodeError(f"node '{spec.name}' (Decoder) has no phase '{phase}'")

    def phase_listen(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        s = self.sizes
        for entry in batch:
            if entry["states"].dim() != 2 or entry["states"].shape[1] != s.hidden:
                raise node.RequestError(f"states must be [frames, {s.hidden}], got {tuple(entry['states'].shape)}",
                                        "states")
        x = torch.cat([entry["states"] for entry in batch]).to(device=self.spec.device, dtype=self.spec.dtype)
        for i, layer in enumerate(self.model.layers):
            k = layer.encoder_attn.k_proj(x).view(-1, s.kv_heads, s.head_dim)
            v = layer.encoder_attn.v_proj(x).view(-1, s.kv_heads, s.head_dim)
            attn.write(i, k, v)
        return [{} for _ in batch]

    def phase_step(self, batch: node.Batch, attn: node.AttentionContext) -> node.Batch:
        s, dev = self.sizes, self.spec.device
        prev = []
        for seq in attn.seqs:
            if self.max_text is not None and seq.start > self.max_text:
                raise node.RequestError(f"the transcript is longer than the {self.max_text} tokens of node "
                                        f"'{self.spec.name}'s text context (max_seq_len)")
            if seq.read_lens[0] == 0:
                raise node.RequestError("a decoder step before any audio was heard (its cross context is empty)")
            out = seq.state.get("tokens")
            if out is None:  # the tokens by position; sized for one step past the bound
                out = seq.state["tokens"] = torch.zeros((self.max_text or 4096) + 2, dtype=torch.long, device=dev)
            prev.append(out[seq.start - 1 : seq.start] if seq.start else torch.full((1,), self.sot, device=dev))
        h = self.model.embed_tokens(torch.cat(prev))
        n = h.shape[0]
        cos, sin = rope_tables(attn.positions(), s.head_dim, ROPE_THETA)
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = apply_rope(a.q_proj(x).view(n, s.heads, s.head_dim), cos, sin)
            k = apply_rope(a.k_proj(x).view(n, s.kv_heads, s.head_dim), cos, sin)
            v = a.v_proj(x).view(n, s.kv_heads, s.head_dim)
            h = h + a.o_proj(attn.attend(i, q, k, v).reshape(n, -1))
            c = layer.encoder_attn
            qc = c.q_proj(layer.encoder_attn_layer_norm(h)).view(n, s.heads, s.head_dim)
            h = h + c.o_proj(attn.attend_to(i, qc, 0).reshape(n, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.model.norm(h)
        tokens = F.linear(h, self.lm_head.weight).argmax(dim=-1)
        eot = tokens == self.eot
        out_batch: node.Batch = []
        for j, seq in enumerate(attn.seqs):
            seq.state["tokens"][seq.start] = tokens[j]
            caught_up = seq.start + 1 >= seq.read_lens[0] // FRAMES_PER_TOKEN
            full = self.max_text is not None and seq.start + 1 >= self.max_text
            out_batch.append({"token": tokens[j : j + 1].to(torch.int32), "done": eot[j] | (caught_up or full)})
        return out_batch


__all__ = ["Decoder", "Encoder", "frame_samples"]
