"""Convert the official V-JEPA 2-AC checkpoint (`vjepa2-ac-vitg.pt`) to a safetensors folder, once.

    python tools/convert_vjepa2.py vjepa2-ac-vitg.pt weights/vjepa2-ac [--dtype bf16]
    mstarc compile models/vjepa2/vjepa2.walk -p placements/h200x1.yaml --weights weights/vjepa2-ac -o v.plan

The `.pt` is read with `torch.load(weights_only=True)`: a plain dict of tensors, no code runs.
Names: models/mstar_models/vjepa2/weights.py (wrappers stripped, stale `pos_embed` dropped).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from mstar_models.vjepa2.weights import convert

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path, help="the official .pt (keys 'encoder' and 'predictor')")
    ap.add_argument("out", type=Path, help="folder to write model.safetensors into")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating tensors (default: keep)")
    args = ap.parse_args(argv)
    try:
        path = convert(args.checkpoint, args.out, DTYPES.get(args.dtype) if args.dtype else None)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"convert_vjepa2: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
