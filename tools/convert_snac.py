"""Convert an official SNAC checkpoint (`pytorch_model.bin` + `config.json`) for serving.

    python tools/convert_snac.py SRC_DIR DST_DIR

SNAC ships a torch pickle; serving never unpickles (a pickle can run code), so this runs once,
offline, with `torch.load(weights_only=True)` (plain tensors only). It:

- folds weight norm into plain `weight` tensors, `w = g * v / ||v||` with the norm over every
  dim but 0 (g has v's dim 0 and size 1 elsewhere), from either form a state dict can hold:
  `parametrizations.weight.original0/original1` (torch >= 2.1, snac 1.2.1) or the legacy
  `weight_g/weight_v`. Folded in float64 and cast back, so the weight is the correctly rounded
  value (SNAC's own float32 recompute in every forward is within an ulp of it);
- keeps what decoding reads (`quantizer.*`, `decoder.*`) and drops `encoder.*`: serving never
  encodes, and the runtime's loader rejects checkpoint tensors no node of the plan claims;
- checks the result against the `snac_decoder` arch (mstarc/archs/snac.py) built from
  config.json: every expected tensor present with its exact shape, nothing unexpected;
- writes DST_DIR/model.safetensors and copies config.json. With `--weights W`, the Orpheus
  SNAC node reads W/snac/ (`SnacDecoder.checkpoint_subdir`), so DST_DIR is usually W/snac.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mstarc.archs.snac import snac_decoder
from mstarc.archs.spec import ArchError

BIN, CONFIG, OUT = "pytorch_model.bin", "config.json", "model.safetensors"
KEEP = ("quantizer.", "decoder.")
_FORMS = ((".parametrizations.weight.original0", ".parametrizations.weight.original1"),
          (".weight_g", ".weight_v"))


class ConvertError(Exception):
    """The source is not a SNAC checkpoint this config describes; the message names the tensor."""


def fold_weight_norm(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every (g, v) pair -> `<module>.weight`; other tensors unchanged."""
    out: dict[str, torch.Tensor] = {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        for g_suffix, v_suffix in _FORMS:
            if name.endswith(g_suffix) or name.endswith(v_suffix):
                suffix = g_suffix if name.endswith(g_suffix) else v_suffix
                pairs.setdefault(name.removesuffix(suffix), {})["g" if suffix == g_suffix else "v"] = t
                break
        else:
            out[name] = t
    for module, gv in pairs.items():
        if set(gv) != {"g", "v"}:
            raise ConvertError(f"weight norm of '{module}' has only its {'g' if 'g' in gv else 'v'} tensor")
        g, v = gv["g"], gv["v"]
        if g.dim() != v.dim() or g.shape[0] != v.shape[0] or any(d != 1 for d in g.shape[1:]):
            raise ConvertError(f"weight norm of '{module}': g {list(g.shape)} does not fit v "
                               f"{list(v.shape)} (expected [{v.shape[0]}, 1, ...]: dim=0)")
        if f"{module}.weight" in out:
            raise ConvertError(f"'{module}.weight' is both a plain and a weight-normed tensor")
        v64 = v.double()
        norm = torch.linalg.vector_norm(v64, dim=tuple(range(1, v.dim())), keepdim=True)
        out[f"{module}.weight"] = (v64 * (g.double() / norm)).to(v.dtype)
    return out


def arch_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json -> the `snac_decoder` arch arguments (what orpheus.walk passes)."""
    try:
        args = {k: config[k] for k in ("encoder_dim", "encoder_rates", "decoder_dim", "decoder_rates",
                                       "codebook_size", "codebook_dim", "vq_strides")}
    except KeyError as e:
        raise ConvertError(f"config.json lacks {e.args[0]!r}") from None
    latent = config.get("latent_dim")
    if latent is not None and latent != args["encoder_dim"] * 2 ** len(args["encoder_rates"]):
        # the arch (and orpheus.walk) derive latent_dim from the encoder; say so rather than guess
        raise ConvertError(f"config.json sets latent_dim={latent}, not encoder_dim * 2^len(encoder_rates)")
    args["depthwise"] = bool(config.get("depthwise", True))
    args["noise"] = bool(config.get("noise", True))
    # SNAC's own default is 32; a released config says null for none, which the arch writes 0
    args["attn_window"] = int(config.get("attn_window_size", 32) or 0)
    return args


def expected_tensors(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    spec = snac_decoder(arch_args(config), "f32")
    return {t.name: tuple(t.shape) for t in spec.tensors}


def _expected(path: Path) -> dict[str, tuple[int, ...]]:
    """The decoder's tensors that the config.json at `path` describes; a ConvertError naming the
    file for one that is no JSON object or whose values do not make a decoder."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, not an object")
        return expected_tensors(config)
    except ConvertError:
        raise
    except (ValueError, TypeError, ArchError) as e:  # JSON, UTF-8, or a value the arch refuses
        raise ConvertError(f"'{path}' is not a SNAC config.json: {e}") from None


def convert(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """SRC_DIR (pytorch_model.bin + config.json) -> DST_DIR (model.safetensors + config.json)."""
    src, dst = Path(src), Path(dst)
    for f in (BIN, CONFIG):
        if not (src / f).is_file():
            raise ConvertError(f"'{src / f}' does not exist")
    want = _expected(src / CONFIG)
    try:
        state = torch.load(src / BIN, map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses anything but tensors and plain containers
        raise ConvertError(f"'{src / BIN}' is not a plain tensor state dict: {e}") from None
    if not isinstance(state, Mapping) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ConvertError(f"'{src / BIN}' does not hold a name -> tensor state dict")
    folded = fold_weight_norm(state)
    kept = {k: t.contiguous() for k, t in folded.items() if k.startswith(KEEP)}
    missing = [n for n in want if n not in kept]
    if missing:
        raise ConvertError(f"tensor '{missing[0]}' {list(want[missing[0]])} is missing from '{src / BIN}'"
                           + (f" ({len(missing) - 1} more)" if len(missing) > 1 else ""))
    for n, shape in want.items():
        if tuple(kept[n].shape) != shape:
            raise ConvertError(f"tensor '{n}' has shape {list(kept[n].shape)}; config.json implies {list(shape)}")
    extra = sorted(set(kept) - set(want))
    if extra:
        raise ConvertError(f"tensor '{extra[0]}' is not part of the SNAC decoder config.json describes"
                           + (f" ({len(extra) - 1} more)" if len(extra) > 1 else ""))
    dst.mkdir(parents=True, exist_ok=True)
    save_file(kept, str(dst / OUT), metadata={"format": "pt", "source": f"snac {BIN}, weight norm folded"})
    shutil.copyfile(src / CONFIG, dst / CONFIG)
    return kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="folder with pytorch_model.bin and config.json")
    ap.add_argument("dst", type=Path, help="output folder (usually <weights>/snac)")
    args = ap.parse_args(argv)
    try:
        kept = convert(args.src, args.dst)
    except ConvertError as e:
        print(f"convert_snac: error: {e}", file=sys.stderr)
        return 1
    n = sum(t.numel() for t in kept.values())
    print(f"wrote {args.dst / OUT}: {len(kept)} tensors, {n / 1e6:.2f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
