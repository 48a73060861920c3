"""Semantic diff of two plan bodies: what changed, by path, in words (`mstarc diff`)."""

from __future__ import annotations

from typing import Any

# Keys whose change is a consequence of another reported change, or pure bookkeeping.
_QUIET = {"tensors", "tensors_sha256", "source_sha256"}


def diff_plans(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out: list[str] = []
    _diff(a, b, "", out)
    if not out and a != b:  # only quiet keys differ
        out.append("plans differ only in bookkeeping fields (tensor lists, source hash)")
    return out


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, dict | list) else (f"{{{len(v)} keys}}" if isinstance(v, dict) else f"[{len(v)} items]")
    return text if len(text) <= 60 else text[:57] + "..."


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in _QUIET:
                continue
            p = f"{path}.{k}" if path else str(k)
            if k not in a:
                out.append(f"+ {p} = {_short(b[k])}")
            elif k not in b:
                out.append(f"- {p} (was {_short(a[k])})")
            else:
                _diff(a[k], b[k], p, out)
        return
    if isinstance(a, list) and isinstance(b, list):
        keyed_a, keyed_b = _by_key(a), _by_key(b)
        if keyed_a is not None and keyed_b is not None:
            _diff(keyed_a, keyed_b, path, out)
            return
        if len(a) != len(b):
            out.append(f"~ {path}: {len(a)} items -> {len(b)} items")
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out)
        return
    if a != b or type(a) is not type(b):
        out.append(f"~ {path}: {_short(a)} -> {_short(b)}")


def _by_key(items: list[Any]) -> dict[str, Any] | None:
    """Lists of records with an id (streams, graphs, edges, steps) diff by id, not by position."""
    keys = []
    for it in items:
        if not isinstance(it, dict):
            return None
        k = it.get("id") or it.get("key")
        if not isinstance(k, str):
            return None
        keys.append(k)
    if len(set(keys)) != len(keys):
        return None
    return {f"[{k}]": it for k, it in zip(keys, items)}
