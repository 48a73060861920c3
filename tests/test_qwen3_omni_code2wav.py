"""Qwen3-Omni's Code2Wav node (models/mstar_models/qwen3_omni/code2wav.py) against transformers 5.24's
`Qwen3OmniMoeCode2Wav`, and its keep-last streaming rule.

The reference is built from a tiny `Qwen3OmniMoeCode2WavConfig` equal to the walk's tiny
variant (hidden 32, 1 layer, decoder_dim 64, 4 quantizers, the real rates: 1920 samples
per frame), its weights spread (`_randomize`) so that no path is near zero and the audio is
not clipped, then written with the checkpoint names (`code2wav.*`) to safetensors and read
by our loader. Tolerance: 1e-5 absolute on fp32 audio in [-1, 1] (about a third of one int16
step); both sides run the same fp32 ops, so what differs is float rounding from batch shapes.

Streaming is checked against one full decode (not HF's `chunked_decode`, whose drop-left
rule loses 555 samples per chunk boundary: a test pins that too). Windows equal the full
decode exactly once their left context covers the receptive field; to test that with few
frames, one reference uses a sliding window of 8 frames (receptive field ~16 frames),
which also checks the window mask where it binds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from mstar_models.qwen3_omni.code2wav import Code2Wav
from mstar_runtime.control.streams import LeftContextChunkPolicy, StreamBuffer
from mstar_runtime.ops.node import RequestError
from mstar_runtime.plan.loader import Plan, load_plan
from mstar_runtime.weights import WeightsError, load_weights

transformers = pytest.importorskip("transformers")
from support import compile_model, cuda_fp32  # noqa: E402
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as hf_config  # noqa: E402
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ATOL = 1e-5  # see the module docstring
G, CODEBOOK = 4, 2048  # the walk's tiny code_groups and codebook_size
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**overrides: Any) -> Any:
    values = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
              "intermediate_size": 64, "decoder_dim": 64, "num_quantizers": G, "codebook_size": CODEBOOK}
    return hf_config.Qwen3OmniMoeCode2WavConfig(**{**values, **overrides})


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights at scales that keep the audio O(0.1) and every branch alive: log-scale Snake
    parameters in [-0.5, 0.5], layer scales and ConvNeXt gammas near 1 (HF starts them at
    0.01 and 1e-6, which would hide the branches they scale), convs ~ 0.6 / sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("alpha", "beta")):
                p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=g))
            elif "scale" in name or name.endswith("gamma"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif "embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                # the upsamplers' transposed convs (kernel = stride) read one tap of each input channel
                fan_in = p.shape[0] if name.startswith("upsample") and ".0.conv" in name else p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * (0.6 if p.dim() > 2 else 1.0) / fan_in**0.5)


def reference(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    model = hf_model.Qwen3OmniMoeCode2Wav(tiny_config(**overrides)).eval()
    _randomize(model, seed)
    return model


def random_codes(frames: int, seed: int) -> torch.Tensor:
    """[frames, G] int32 codes, the layout of the walk's `code_predictor.frame` items."""
    return torch.randint(0, CODEBOOK, (frames, G), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def hf_decode(model: torch.nn.Module, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(codes.T[None].long())[0, 0]


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    return load_plan(compile_model(tmp_path_factory.mktemp("qwen3_omni") / "tiny.plan", "qwen3_omni"), device="cpu")


def ours_from(plan: Plan, ref: torch.nn.Module, folder: Path, **settings: Any) -> Code2Wav:
    """Our node from the plan, its weights written under the checkpoint names and read by the loader."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({f"code2wav.{k}": v.contiguous() for k, v in ref.state_dict().items()},
              str(folder / "model.safetensors"))
    spec = plan.node_spec("code2wav", device="cpu")
    node = Code2Wav(dataclasses.replace(spec, settings={**spec.settings, **settings})).eval()
    load_weights(node, plan, "code2wav", folder)
    return node


@pytest.fixture(scope="module")
def hf72() -> torch.nn.Module:
    return reference(0)


@pytest.fixture(scope="module")
def ours72(plan: Plan, hf72: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Code2Wav:
    return ours_from(plan, hf72, tmp_path_factory.mktemp("c2w72"))


@pytest.fixture(scope="module")
def hf8() -> torch.nn.Module:
    return reference(1, sliding_window=8)


@pytest.fixture(scope="module")
def ours8(plan: Plan, hf8: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Code2Wav:
    return ours_from(plan, hf8, tmp_path_factory.mktemp("c2w8"), sliding_window=8)


def decode(node: Code2Wav, *windows: tuple[torch.Tensor, int]) -> list[torch.Tensor]:
    """One batched `decode` step over (codes, left-context frames) windows."""
    with torch.no_grad():
        out = node.run("decode", [{"codes": c, "codes:context": ctx} for c, ctx in windows])
    return [o["pcm"] for o in out]


# --------------------------------------------------------------------------- parity
def test_batched_decode_equals_transformers(ours72: Code2Wav, hf72: torch.nn.Module) -> None:
    windows = [random_codes(n, seed) for seed, n in enumerate((9, 14, 20))]
    got = decode(ours72, *[(w, 0) for w in windows])
    for w, pcm in zip(windows, got, strict=True):
        ref = hf_decode(hf72, w)
        assert pcm.dtype == torch.float32 and pcm.shape == ref.shape == (1920 * w.shape[0] - 555,)
        assert float(ref.std()) > 0.02 and float((ref.abs() < 1).float().mean()) > 0.99  # alive, barely clipped
        torch.testing.assert_close(pcm, ref, atol=ATOL, rtol=0)


def test_windows_split_over_forwards_decode_the_same(plan: Plan, hf72: torch.nn.Module, ours72: Code2Wav,
                                                    tmp_path: Path) -> None:
    """`max_windows_per_forward` = 2 decodes 5 windows in 3 forwards: the same samples as one."""
    windows = [(random_codes(n, seed), ctx) for seed, (n, ctx) in enumerate(((9, 0), (14, 4), (20, 8), (6, 0), (11, 3)))]
    split = ours_from(plan, hf72, tmp_path / "split", max_windows_per_forward=2)
    assert split.max_windows == 2 and ours72.max_windows == 8
    for a, b in zip(decode(split, *windows), decode(ours72, *windows), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_sliding_window_binds_as_in_transformers(ours8: Code2Wav, hf8: torch.nn.Module) -> None:
    codes = random_codes(30, 7)  # 30 frames > the 8-frame window
    torch.testing.assert_close(decode(ours8, (codes, 0))[0], hf_decode(hf8, codes), atol=ATOL, rtol=0)


def test_window_length_rule(ours72: Code2Wav) -> None:
    # docs/models/qwen3_omni.md, Facts: W frames -> 1920 W - 555 samples; keep-last keeps new * 1920 of a window with context
    assert (ours72.samples_per_frame, ours72.trim) == (1920, 555)
    assert [ours72.output_length(w) for w in (0, 1, 4, 25)] == [0, 1365, 7125, 47445]
    assert ours72.kept_range(50, 25) == (47445, 95445)
    assert ours72.kept_range(7, 0) == (0, 12885)


# ------------------------------------------------------------------------- streaming
def stream_windows(codes: torch.Tensor, chunk: int, left: int) -> list[tuple[torch.Tensor, int]]:
    """The windows the runtime's left_context stream buffer hands Code2Wav for `codes`, pushed frame by frame."""
    buf = StreamBuffer(LeftContextChunkPolicy(chunk, left), capacity=chunk)
    out: list[tuple[torch.Tensor, int]] = []
    for frame in codes:
        buf.push(frame[None])
        out += [(c.items, c.context) for c in buf.pop_ready()]
    buf.close()
    out += [(c.items, c.context) for c in buf.pop_ready()]
    return out


def test_streamed_windows_equal_one_full_decode(ours8: Code2Wav) -> None:
    codes = random_codes(43, 3)
    full = decode(ours8, (codes, 0))[0]
    windows = stream_windows(codes, chunk=5, left=16)  # 16 frames cover the receptive field
    assert len(windows) == 9 and windows[-1][0].shape[0] == 16 + 3  # the partial last chunk
    streamed = torch.cat(decode(ours8, *windows))  # every window of the stream in one batch
    assert streamed.shape == full.shape == (1920 * 43 - 555,)
    torch.testing.assert_close(streamed, full, atol=ATOL, rtol=0)
    one_by_one = torch.cat([decode(ours8, w)[0] for w in windows])
    torch.testing.assert_close(one_by_one, full, atol=ATOL, rtol=0)


def test_walk_chunks_tile_the_full_decode(plan: Plan, ours72: Code2Wav) -> None:
    chunk, left = plan.config["c2w_chunk"], plan.config["c2w_left"]  # tiny: 4 and 4
    codes = random_codes(18, 4)
    full = decode(ours72, (codes, 0))[0]
    windows = stream_windows(codes, chunk, left)
    parts = decode(ours72, *windows)
    assert sum(p.numel() for p in parts) == full.numel()  # no sample lost or doubled at a boundary
    # windows that start at frame 0 (the first two) see the whole history: exact
    exact = parts[0].numel() + parts[1].numel()
    torch.testing.assert_close(torch.cat(parts)[:exact], full[:exact], atol=ATOL, rtol=0)
    # later windows miss history the 72-frame window would see: an approximation only
    assert not torch.allclose(torch.cat(parts)[exact:], full[exact:], atol=ATOL, rtol=0)


def test_drop_left_rule_loses_555_samples_per_boundary(hf8: torch.nn.Module) -> None:
    # why the node keeps the last samples: HF's chunked_decode drops ctx * 1920 from the left
    codes = random_codes(20, 5).T[None].long()
    with torch.no_grad():
        chunked = hf8.chunked_decode(codes, chunk_size=5, left_context_size=4)
    assert chunked.shape[-1] == 1920 * 20 - 555 - 3 * 555  # 4 chunks, 3 boundaries


# --------------------------------------------------------------------------- inputs
@pytest.mark.parametrize(
    ("codes", "context"),
    [
        (torch.zeros(4, G), 0),  # floats
        (torch.zeros(4, G + 1, dtype=torch.int32), 0),  # wrong group count
        (torch.zeros(G, dtype=torch.int32), 0),  # 1-D
        (torch.full((3, G), CODEBOOK, dtype=torch.int32), 0),  # out of the codebook
        (torch.full((3, G), -1, dtype=torch.int32), 0),
        (torch.zeros(3, G, dtype=torch.int32), 4),  # more context than frames
    ],
)
def test_bad_windows_are_request_errors(ours72: Code2Wav, codes: torch.Tensor, context: int) -> None:
    with pytest.raises(RequestError) as err:
        decode(ours72, (codes, context))
    assert err.value.field == "codes"


def test_empty_window_gives_no_samples(ours72: Code2Wav) -> None:
    out = decode(ours72, (torch.zeros(0, G, dtype=torch.int32), 0), (random_codes(2, 0), 0))
    assert out[0].shape == (0,) and out[1].shape == (1920 * 2 - 555,)


def test_loader_names_a_missing_tensor(plan: Plan, hf72: torch.nn.Module, tmp_path: Path) -> None:
    state = {f"code2wav.{k}": v for k, v in hf72.state_dict().items() if not k.endswith("decoder.6.conv.bias")}
    save_file(state, str(tmp_path / "model.safetensors"))
    node = Code2Wav(plan.node_spec("code2wav", device="cpu"))
    with pytest.raises(WeightsError, match=r"code2wav\.decoder\.6\.conv\.bias"):
        load_weights(node, plan, "code2wav", tmp_path)


@pytest.mark.gpu
def test_real_size_code2wav_on_gpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The released Code2Wav (docs/models/qwen3_omni.md, Facts) on the GPU in fp32 (TF32 off): one decode equals
    transformers', and 25-frame chunks with 25 frames of left context tile it (keep-last)."""
    dev = cuda_fp32()
    plan = load_plan(compile_model(tmp_path_factory.mktemp("qwen3_omni_real") / "real.plan", "qwen3_omni",
                                   "placements/h200x1.yaml", variant="real"))
    with torch.device(dev):
        torch.manual_seed(0)
        ref = hf_model.Qwen3OmniMoeCode2Wav(hf_config.Qwen3OmniMoeCode2WavConfig()).eval()
    _randomize(ref, 0)
    spec = plan.node_spec("code2wav", device=dev)
    node = Code2Wav(dataclasses.replace(spec, dtype=torch.float32)).eval()  # the real plan computes in bf16
    node.load_state_dict(ref.state_dict())
    codes = torch.randint(0, 2048, (80, 16), generator=torch.Generator().manual_seed(0), dtype=torch.int32).to(dev)
    with torch.no_grad():
        full = node.run("decode", [{"codes": codes, "codes:context": 0}])[0]["pcm"]
        want = ref(codes.T[None].long())[0, 0]
        torch.testing.assert_close(full, want, atol=1e-4, rtol=0)
        windows = stream_windows(codes, 25, 25)
        parts = node.run("decode", [{"codes": c, "codes:context": ctx} for c, ctx in windows])
    streamed = torch.cat([p["pcm"] for p in parts])
    assert streamed.shape == full.shape == (1920 * 80 - 555,)
    first = parts[0]["pcm"].numel() + parts[1]["pcm"].numel()  # windows from frame 0: exact
    torch.testing.assert_close(streamed[:first], full[:first], atol=1e-4, rtol=0)
