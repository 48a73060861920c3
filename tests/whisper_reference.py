"""transformers' Whisper set up as the M* walk's config describes it: the parity reference of
tests/test_whisper.py, tests/test_gpu_whisper.py and tools/bench/whisper.py.

- `hf_config(cfg)`: a `WhisperConfig` of the walk variant's sizes (`plan.config`);
- `generation_config(cfg)`: the walk's token rules as transformers' `GenerationConfig`
  (whisper-large-v3's generation_config.json when the config holds its values);
- `from_nodes(encoder, decoder, cfg)`: a `WhisperForConditionalGeneration` holding our nodes'
  weights (their state dicts are the checkpoint's `model.encoder.*` / `model.decoder.*`
  names, so they load strictly; `proj_out` stays tied to the decoder's embedding).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar_models.whisper.tokens import LANGUAGE_CODES


def hf_config(cfg: Mapping[str, Any]) -> Any:
    import transformers

    eot, sot = int(cfg["eot"]), int(cfg["sot"])
    return transformers.WhisperConfig(
        vocab_size=int(cfg["vocab"]), num_mel_bins=int(cfg["mels"]), encoder_layers=int(cfg["encoder_layers"]),
        decoder_layers=int(cfg["decoder_layers"]), d_model=int(cfg["hidden"]),
        encoder_attention_heads=int(cfg["encoder_heads"]), decoder_attention_heads=int(cfg["decoder_heads"]),
        encoder_ffn_dim=int(cfg["encoder_ffn"]), decoder_ffn_dim=int(cfg["decoder_ffn"]),
        max_source_positions=int(cfg["source_positions"]), max_target_positions=int(cfg["target_positions"]),
        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, decoder_start_token_id=sot)


def generation_config(cfg: Mapping[str, Any]) -> Any:
    import transformers

    eot, sot, langs = int(cfg["eot"]), int(cfg["sot"]), int(cfg["languages"])
    translate = sot + 1 + langs
    return transformers.GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
        no_timestamps_token_id=translate + 5, prev_sot_token_id=translate + 3,
        suppress_tokens=list(cfg["suppress_tokens"]),
        begin_suppress_tokens=list(cfg["begin_suppress_tokens"]),
        max_initial_timestamp_index=int(cfg["max_initial_timestamp"]), is_multilingual=True,
        max_length=int(cfg["target_positions"]),
        lang_to_id={f"<|{c}|>": sot + 1 + i for i, c in enumerate(LANGUAGE_CODES[:langs])},
        task_to_id={"translate": translate, "transcribe": translate + 1})


def from_nodes(encoder: torch.nn.Module, decoder: torch.nn.Module, cfg: Mapping[str, Any],
               dtype: torch.dtype | None = None, attn: str = "sdpa") -> Any:
    import transformers

    device = next(decoder.parameters()).device
    dtype = dtype or next(decoder.parameters()).dtype
    with torch.device(device):
        model = transformers.WhisperForConditionalGeneration._from_config(
            hf_config(cfg), attn_implementation=attn, dtype=dtype).eval()
    model.model.encoder.load_state_dict(encoder.state_dict(), strict=True)
    model.model.decoder.load_state_dict(decoder.state_dict(), strict=True)
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
    model.generation_config = generation_config(cfg)
    return model.to(dtype)
