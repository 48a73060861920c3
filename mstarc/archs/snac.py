"""SNAC neural audio codec (hubertsiuzdak/snac 1.2.1), in its `nn.Sequential` state-dict names.

Owns `snac_decoder` (what Orpheus' SNAC node loads: `quantizer.*` + `decoder.*`) and
`snac` (the whole codec, encoder included, so the catalogue can be checked against the
published 19.8M parameters of snac_24khz).

Names follow the package's modules with weight norm folded to a plain `weight`: the loader
turns `parametrizations.weight.original0/1` (or legacy `weight_g/weight_v`) into
`w = g * v / ||v||`, so the folded tensor has v's shape. Shapes follow PyTorch: Conv1d
[out, in / groups, k], ConvTranspose1d [in, out, k], Snake alpha [1, C, 1].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstarc.archs._common import BOOL, INT, INTS, Tensors, parse_args, require
from mstarc.archs.spec import ArchSpec

SNAC_ARGS = {
    "encoder_dim": INT(),
    "encoder_rates": INTS(),
    "decoder_dim": INT(),
    "decoder_rates": INTS(),
    "codebook_size": INT(),
    "codebook_dim": INT(),
    "vq_strides": INTS(),
    "depthwise": BOOL(True),
    "noise": BOOL(True),
    # SNAC's attn_window_size; 0 stands for config.json's null (no LocalMHA), which the
    # .walk language cannot write
    "attn_window": INT(0, minimum=0),
    # codes per decode call (a node's window, e.g. 28 = 4 frames of 7); 0 = not known. When
    # given, the arch states the activation a decode of one window holds at its peak
    # (`activation_elements`), which the compiler's memory pass budgets per batch row.
    "window": INT(0, minimum=0),
}

_ATTN_HEAD_DIM = 64  # LocalMHA's dim_head


def _snake(t: Tensors, prefix: str, channels: int) -> None:
    t.add(f"{prefix}.alpha", (1, channels, 1))


def _local_mha(t: Tensors, prefix: str, dim: int) -> None:
    t.norm(f"{prefix}.norm", dim, bias=True)
    t.linear(f"{prefix}.to_qkv", 3 * dim, dim, bias=False)
    # SinusoidalEmbeddings registers inv_freq as a persistent buffer, so it is in the state dict
    t.add(f"{prefix}.rel_pos.inv_freq", (_ATTN_HEAD_DIM // 2,))
    t.linear(f"{prefix}.to_out", dim, dim, bias=False)


def _residual_unit(t: Tensors, prefix: str, dim: int, groups: int) -> None:
    _snake(t, f"{prefix}.block.0", dim)
    t.conv(f"{prefix}.block.1", dim, dim // groups, (7,))
    _snake(t, f"{prefix}.block.2", dim)
    t.conv(f"{prefix}.block.3", dim, dim, (1,))


def _quantizer(t: Tensors, latent: int, a: dict[str, Any]) -> None:
    for i, _stride in enumerate(a["vq_strides"]):
        p = f"quantizer.quantizers.{i}"
        # in_proj is unused by decoding (from_codes) but is part of the quantizer's state
        t.conv(f"{p}.in_proj", a["codebook_dim"], latent, (1,))
        t.conv(f"{p}.out_proj", latent, a["codebook_dim"], (1,))
        t.add(f"{p}.codebook.weight", (a["codebook_size"], a["codebook_dim"]))


def _decoder(t: Tensors, latent: int, a: dict[str, Any]) -> None:
    ch, depthwise = a["decoder_dim"], a["depthwise"]
    k = 0

    def idx() -> str:
        nonlocal k
        k += 1
        return f"decoder.model.{k - 1}"

    if depthwise:
        t.conv(idx(), latent, 1, (7,))  # groups = latent: one filter per channel
        t.conv(idx(), ch, latent, (1,))
    else:
        t.conv(idx(), ch, latent, (7,))
    if a["attn_window"]:
        _local_mha(t, idx(), ch)
    out_dim = ch
    for i, stride in enumerate(a["decoder_rates"]):
        in_dim, out_dim = ch // 2**i, ch // 2 ** (i + 1)
        groups = out_dim if depthwise else 1
        p = f"{idx()}.block"
        _snake(t, f"{p}.0", in_dim)
        t.conv_transpose(f"{p}.1", in_dim, out_dim, (2 * stride,))
        j = 2
        if a["noise"]:
            t.conv(f"{p}.2.linear", out_dim, out_dim, (1,), bias=False)
            j = 3
        for d in range(3):  # dilations 1, 3, 9
            _residual_unit(t, f"{p}.{j + d}", out_dim, groups)
    _snake(t, idx(), out_dim)
    t.conv(idx(), 1, out_dim, (7,))
    # the trailing nn.Tanh has no parameters


def _encoder(t: Tensors, a: dict[str, Any]) -> None:
    d, depthwise = a["encoder_dim"], a["depthwise"]
    t.conv("encoder.block.0", d, 1, (7,))
    k = 1
    for stride in a["encoder_rates"]:
        d *= 2
        half = d // 2
        groups = half if depthwise else 1
        p = f"encoder.block.{k}.block"
        for j in range(3):
            _residual_unit(t, f"{p}.{j}", half, groups)
        _snake(t, f"{p}.3", half)
        t.conv(f"{p}.4", d, half, (2 * stride,))
        k += 1
    if a["attn_window"]:
        _local_mha(t, f"encoder.block.{k}", d)
        k += 1
    t.conv(f"encoder.block.{k}", d, 1 if depthwise else d, (7,))


def _parse(name: str, args: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    a = parse_args(name, args, SNAC_ARGS)
    levels = len(a["decoder_rates"])
    require(a["decoder_dim"] % 2**levels == 0,
            f"decoder_dim ({a['decoder_dim']}) must be divisible by 2^{levels} (one halving per decoder rate)",
            "decoder_dim")
    if a["attn_window"]:
        require(a["decoder_dim"] % _ATTN_HEAD_DIM == 0,
                f"decoder_dim must be a multiple of {_ATTN_HEAD_DIM} with local attention", "decoder_dim")
    latent = a["encoder_dim"] * 2 ** len(a["encoder_rates"])  # latent_dim=None in the config
    return a, latent


def decode_peak_elements(a: Mapping[str, Any], window: int) -> int:
    """Activation elements a decode of `window` codes holds at its peak: the largest, over the
    decoder blocks, of the block's input plus three tensors of its upsampled output (the
    transposed conv's output, a residual unit's inner tensor, their sum).

    A frame holds one code per quantizer time step: sum(max_stride / s) codes (7 for strides
    [4, 2, 1]) over max_stride latent steps; each decoder rate multiplies the length."""
    strides = a["vq_strides"]
    per_frame = sum(max(strides) // s for s in strides)
    require(window % per_frame == 0, f"window ({window}) must be whole frames of {per_frame} codes", "window")
    length = window // per_frame * max(strides)
    ch, peak = a["decoder_dim"], 0
    for i, rate in enumerate(a["decoder_rates"]):
        in_dim, out_dim = ch // 2**i, ch // 2 ** (i + 1)
        peak = max(peak, in_dim * length + 3 * out_dim * length * rate)
        length *= rate
    return peak


def snac_decoder(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a, latent = _parse("snac_decoder", args)
    t = Tensors(dtype)
    _quantizer(t, latent, a)
    _decoder(t, latent, a)
    dims = {"hidden": a["decoder_dim"]}
    if a["window"]:
        dims["activation_elements"] = decode_peak_elements(a, a["window"])
    return t.spec(dims, None)


def snac(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a, latent = _parse("snac", args)
    t = Tensors(dtype)
    _encoder(t, a)
    _quantizer(t, latent, a)
    _decoder(t, latent, a)
    return t.spec({"hidden": a["decoder_dim"]}, None)


ARCHS = {"snac_decoder": snac_decoder, "snac": snac}
