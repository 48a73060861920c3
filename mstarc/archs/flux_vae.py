"""The FLUX autoencoder (BFL naming, `ae.safetensors`), as BAGEL uses it for generation.

Owns `flux_vae_encoder` (`encoder.*`) and `flux_vae_decoder` (`decoder.*`): conv_in,
ResNet blocks per level (GroupNorm(32) + 3x3 convs, a 1x1 `nin_shortcut` when the width
changes), a stride-2 `downsample.conv` / `upsample.conv` between levels, a mid block with one
single-head attention (1x1 q/k/v/proj_out convs), GroupNorm `norm_out` and conv_out. The
encoder's conv_out emits 2 * z_channels (mean and log-variance); there is no quant_conv.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstarc.archs._common import INT, INTS, Tensors, parse_args, require
from mstarc.archs.spec import ArchSpec

VAE_ARGS = {
    "ch": INT(),
    "ch_mult": INTS(),
    "res_blocks": INT(),
    "z_channels": INT(),
    "channels": INT(3),  # image channels (encoder input, decoder output)
}

_GROUPS = 32  # GroupNorm(32, C) everywhere


def _resnet(t: Tensors, p: str, c_in: int, c_out: int) -> None:
    t.norm(f"{p}.norm1", c_in, bias=True)
    t.conv(f"{p}.conv1", c_out, c_in, (3, 3))
    t.norm(f"{p}.norm2", c_out, bias=True)
    t.conv(f"{p}.conv2", c_out, c_out, (3, 3))
    if c_in != c_out:
        t.conv(f"{p}.nin_shortcut", c_out, c_in, (1, 1))


def _mid(t: Tensors, p: str, c: int) -> None:
    _resnet(t, f"{p}.block_1", c, c)
    t.norm(f"{p}.attn_1.norm", c, bias=True)
    for name in ("q", "k", "v", "proj_out"):
        t.conv(f"{p}.attn_1.{name}", c, c, (1, 1))
    _resnet(t, f"{p}.block_2", c, c)


def _parse(name: str, args: Mapping[str, Any]) -> dict[str, Any]:
    a = parse_args(name, args, VAE_ARGS)
    widths = [a["ch"] * m for m in a["ch_mult"]]
    require(a["ch"] % _GROUPS == 0 and all(w % _GROUPS == 0 for w in widths),
            f"every VAE width (ch * ch_mult = {[a['ch'], *widths]}) must be a multiple of {_GROUPS} (GroupNorm)", "ch")
    return a


def flux_vae_encoder(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = _parse("flux_vae_encoder", args)
    t = Tensors(dtype)
    ch, mult = a["ch"], a["ch_mult"]
    t.conv("encoder.conv_in", ch, a["channels"], (3, 3))
    in_mult = (1, *mult)
    block_in = ch
    for level, m in enumerate(mult):
        block_in, block_out = ch * in_mult[level], ch * m
        for b in range(a["res_blocks"]):
            _resnet(t, f"encoder.down.{level}.block.{b}", block_in, block_out)
            block_in = block_out
        if level != len(mult) - 1:
            t.conv(f"encoder.down.{level}.downsample.conv", block_in, block_in, (3, 3))
    _mid(t, "encoder.mid", block_in)
    t.norm("encoder.norm_out", block_in, bias=True)
    t.conv("encoder.conv_out", 2 * a["z_channels"], block_in, (3, 3))
    return t.spec({"hidden": ch * mult[-1]}, None)


def flux_vae_decoder(args: Mapping[str, Any], dtype: str) -> ArchSpec:
    a = _parse("flux_vae_decoder", args)
    t = Tensors(dtype)
    ch, mult = a["ch"], a["ch_mult"]
    block_in = ch * mult[-1]
    t.conv("decoder.conv_in", block_in, a["z_channels"], (3, 3))
    _mid(t, "decoder.mid", block_in)
    # built from the deepest level up, stored as decoder.up.{level} (up.insert(0, ...))
    for level in reversed(range(len(mult))):
        block_out = ch * mult[level]
        for b in range(a["res_blocks"] + 1):
            _resnet(t, f"decoder.up.{level}.block.{b}", block_in, block_out)
            block_in = block_out
        if level != 0:
            t.conv(f"decoder.up.{level}.upsample.conv", block_in, block_in, (3, 3))
    t.norm("decoder.norm_out", block_in, bias=True)
    t.conv("decoder.conv_out", a["channels"], block_in, (3, 3))
    return t.spec({"hidden": ch * mult[-1]}, None)


ARCHS = {"flux_vae_encoder": flux_vae_encoder, "flux_vae_decoder": flux_vae_decoder}
