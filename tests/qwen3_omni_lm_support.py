"""Shared fixtures of the Qwen3-Omni LM tests: the tiny HF model (the walk's tiny sizes), its
checkpoint written by `save_pretrained`, the compiled tiny plan, and a paged-KV harness."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from support import compile_walk

from mstar_models.qwen3_omni.tokens import SPEAKERS, TokenIds
from mstar_runtime.engine.engines import KVCacheEngine, KVSlots, StepEntry
from mstar_runtime.kv.block_manager import BlockManager
from mstar_runtime.ops.node import KVNode
from mstar_runtime.ops.readback import resolve
from mstar_runtime.plan.loader import Plan, load_plan

ROOT = Path(__file__).resolve().parent.parent
WALK = ROOT / "models/qwen3_omni/qwen3_omni.walk"

# The nodes' ids at the tiny vocab (512): the bundled tiny tokenizer's (tokens.TokenIds.tiny());
# the HF reference is configured with the same ones. The codec ids keep their released values.
TINY_IDS = {f.name: getattr(TokenIds.tiny(), f.name) for f in dataclasses.fields(TokenIds) if f.name.endswith("token_id")}
NEWLINE = 10  # any ordinary id: the "\n" after the role


def compile_plan(out: Path) -> Plan:
    return load_plan(compile_walk(out, WALK))


def hf_config() -> Any:
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as C

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "interleaved": True}
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                norm_topk_prob=True, rope_parameters=rope)
    thinker = dict(
        text_config=text,
        audio_config=dict(encoder_layers=2, d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64,
                          num_mel_bins=128, downsample_hidden_size=8, output_dim=64),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                           deepstack_visual_indexes=[0, 1], num_position_embeddings=64),
        position_id_per_seconds=13,
        **{k: v for k, v in TINY_IDS.items() if k in ("audio_token_id", "image_token_id", "video_token_id",
                                                         "audio_start_token_id", "vision_start_token_id",
                                                         "user_token_id")},
    )
    talker_text = dict(vocab_size=3072, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                       norm_topk_prob=True, rope_parameters=rope)
    predictor = dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=4,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    talker = dict(text_config=talker_text, code_predictor_config=predictor, num_code_groups=4, thinker_hidden_size=64,
                  accept_hidden_layer=1, spatial_merge_size=2, position_id_per_seconds=13, speaker_id=dict(SPEAKERS),
                  codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_nothink_id=2155,
                  codec_think_bos_id=2156, codec_think_eos_id=2157,
                  **{k: v for k, v in TINY_IDS.items() if k in ("audio_token_id", "image_token_id", "video_token_id",
                                                                  "audio_start_token_id", "vision_start_token_id")})
    code2wav = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                    intermediate_size=64, num_quantizers=4, decoder_dim=64)
    top = {k: v for k, v in TINY_IDS.items() if k in ("im_start_token_id", "im_end_token_id", "system_token_id",
                                                        "user_token_id", "assistant_token_id", "tts_pad_token_id",
                                                        "tts_bos_token_id", "tts_eos_token_id")}
    return C.Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, **top)


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights that make every part matter: matrices N(0, 1/fan_in) (embeddings N(0, 0.5^2)),
    gains 1 + N(0, 0.1^2), biases N(0, 0.1^2), so logits spread wide and greedy gaps are far
    above float noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name:
                values = 0.5 * torch.randn(p.shape, generator=gen)
            elif p.dim() >= 2:
                values = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            elif name.endswith("bias"):
                values = 0.1 * torch.randn(p.shape, generator=gen)
            else:
                values = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(values)
    return model


def hf_model(seed: int = 0) -> Any:
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as M

    torch.manual_seed(seed)
    model = M.Qwen3OmniMoeForConditionalGeneration(hf_config())
    # HF's own per-expert loop as the reference (5.24 defaults to torch's grouped GEMM, the kernel we use)
    model.set_experts_implementation("eager")
    return randomize_(model, seed).eval()


def node_spec(plan: Plan, name: str, **settings: Any) -> Any:
    spec = plan.node_spec(name, device="cpu")
    # what the walk's tiny variant lacks: the talker's top-k (2 here, 6 released)
    config = {**spec.config, "talker_experts_per_token": 2}
    return dataclasses.replace(spec, config=config, settings={**spec.settings, **settings})


class Harness:
    """A KV node behind the runtime's paged KVCacheEngine; records the logits `watch` returns."""

    def __init__(self, node: KVNode, ports: dict[str, tuple[str, ...]], pages: int = 256, page_size: int = 4,
                 watch: str | None = "logits"):
        self.node = node
        self.engine = KVCacheEngine(node, pages, page_size, node.spec.dtype, node.spec.device, output_ports=ports)
        self.blocks = BlockManager(pages, page_size)
        self.logits: list[torch.Tensor] = []
        if watch is not None:
            inner: Callable[..., torch.Tensor] = getattr(node, watch)

            def recording(*args: Any) -> torch.Tensor:
                out = inner(*args)
                self.logits.append(out.clone())
                return out

            setattr(node, watch, recording)

    def step(self, phase: str, entries: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        batch = []
        for rid, inputs in entries:
            shapes = {k: tuple(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
            plan = type(self.node).kv_plan(phase, shapes, self.node.spec)
            key = (rid, "main")
            start = self.blocks.seq_len(key) if key in self.blocks else 0
            slots = self.blocks.append(key, plan.q_len)
            batch.append(StepEntry(rid, None, inputs, KVSlots(start, plan.q_len, slots, self.blocks.page_table(key))))
        return [{k: resolve(v) for k, v in out.items()} for out in self.engine.run(phase, batch)]
