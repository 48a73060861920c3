"""Checkpoint headers: tensor names, dtypes and shapes from safetensors files, without torch.

A safetensors file starts with an 8-byte little-endian header length and a JSON header that
maps tensor names to dtype, shape and byte offsets. Reading only headers lets the compiler
size a 65 GB checkpoint in milliseconds. Both layouts are accepted: a single
`*.safetensors` file, or shards listed by `model.safetensors.index.json`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from mstar_runtime import safetensors_header
from mstarc import ir as I
from mstarc import limits
from mstarc.diagnostics import CompileError, Diagnostic, Span

_ST_DTYPES = {"BF16": "bf16", "F16": "f16", "F32": "f32", "I32": "i32", "I64": "i64", "U8": "u8", "BOOL": "bool",
              "F64": "f64", "I8": "i8", "I16": "i16", "F8_E4M3": "f8e4m3", "F8_E5M2": "f8e5m2"}


class CheckpointError(Exception):
    pass


def read_header(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], str]:
    """(name -> (dtype, shape), sha256 of the raw header) of one safetensors file."""
    try:
        tensors, digest = safetensors_header.read_header(path)
    except safetensors_header.HeaderError as e:
        raise CheckpointError(str(e)) from None
    return ({name: (_ST_DTYPES.get(meta["dtype"], str(meta["dtype"]).lower()), tuple(int(d) for d in meta["shape"]))
             for name, meta in tensors.items()}, digest)


def scan(folder: str | Path) -> I.CheckpointIR:
    """All safetensors headers of a weights folder (index-driven when an index exists)."""
    root = Path(folder)
    if not root.is_dir():
        raise CheckpointError(f"weights folder '{folder}' {'is not a folder' if root.exists() else 'does not exist'}")
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            text = limits.read_text_capped(index, str(index), limits.MAX_JSON_BYTES)
            weight_map = json.loads(text)["weight_map"]
            names = sorted(set(weight_map.values()))
        except CompileError as e:  # over the size cap, or not a regular file
            raise CheckpointError(e.diagnostics[0].message) from None
        except OSError as e:  # missing, unreadable, a named pipe
            raise CheckpointError(f"cannot read '{index}': {e.strerror or e}") from None
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise CheckpointError(f"'{index}' is not a valid safetensors index") from None
    else:
        names = sorted(p.name for p in root.glob("*.safetensors"))
    if not names:
        raise CheckpointError(f"weights folder '{folder}' holds no .safetensors files")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    files = []
    for name in names:
        path = root / name
        header, digest = read_header(path)
        for t, v in header.items():
            if t in tensors:
                raise CheckpointError(f"tensor '{t}' appears in more than one file (second: '{name}')")
            tensors[t] = v
        files.append((name, digest, path.stat().st_size))
    return I.CheckpointIR("dir", os.path.relpath(root), tuple(files), tensors)


def with_subdirs(model: I.ModelIR, folder: str | Path) -> I.ModelIR:
    """Merge the checkpoints that nodes keep in sub-folders (`checkpoint_subdir = "snac"`).

    A composite model ships several checkpoints (Orpheus: the Llama backbone and SNAC); the
    node setting names the sub-folder of the weights folder that holds a node's tensors.
    Their files are listed as `<subdir>/<file>`.
    """
    ck = model.checkpoint
    tensors = dict(ck.tensors)
    files = list(ck.files)
    for node in model.nodes.values():
        sub = node.settings.get("checkpoint_subdir")
        if not isinstance(sub, str) or not sub:
            continue
        part = scan(Path(folder) / sub)
        for name, value in part.tensors.items():
            if name in tensors:
                raise CheckpointError(f"tensor '{name}' of sub-folder '{sub}' is also in another checkpoint file")
            tensors[name] = value
        files.extend((f"{sub}/{n}", h, s) for n, h, s in part.files)
    return dataclasses.replace(model, checkpoint=dataclasses.replace(ck, files=tuple(files), tensors=tensors))


def compare(model: I.ModelIR) -> list[Diagnostic]:
    """E062 for every arch tensor the checkpoint lacks or holds with another shape (first 20 per node)."""
    diags: list[Diagnostic] = []
    ck = model.checkpoint
    if ck.kind != "dir":
        return diags
    for node in model.nodes.values():
        if node.arch is None:
            continue
        problems = []
        for t in node.arch.tensors:
            got = ck.tensors.get(t.name)
            if got is None:
                problems.append(f"missing tensor '{t.name}' {list(t.shape)}")
            elif got[1] != tuple(t.shape):
                problems.append(f"tensor '{t.name}' has shape {list(got[1])}, expected {list(t.shape)}")
        for p in problems[:20]:
            diags.append(Diagnostic("E062", f"node '{node.name}': {p}", node.span or Span.unknown(model.source),
                                    f"checkpoint folder: {ck.path}"))
        if len(problems) > 20:
            diags.append(Diagnostic("E062", f"node '{node.name}': {len(problems) - 20} more mismatches", node.span))
    return diags
