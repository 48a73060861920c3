"""Node settings: the ones the compiler or the runtime reads, with their types.

A setting in a node's body (`max_seq_len = 8192`) must be one of `NODE_SETTINGS`, with a
value of its kind, else E026: a misspelt setting would otherwise be silently ignored. What
only the node's implementation reads is written as the implementation's arguments
(`node p : kv = vjepa2.ACPredictor(max_steps = 32) { ... }`), which the compiler records
without reading. Both end up in the plan's `settings` of the node (the runtime hands them
to the implementation as `NodeSpec.settings`). A KV tag's own bound (`tags main,
cross(max_len = 1500)`) takes `TAG_ARGS`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from mstar_runtime.plan.check import MAX_STREAM_ITEMS
from mstarc import ir as I


@dataclass(frozen=True)
class SettingSpec:
    kind: str  # "positive_int" | "bool" | "str" | "dtype"
    reader: str  # who reads it (docs/walk-language.md lists the same)
    hi: int | None = None  # the largest value of a positive_int the plan can hold (plan/check.py)


NODE_SETTINGS: dict[str, SettingSpec] = {
    "dtype": SettingSpec("dtype", "lowering"),
    "max_seq_len": SettingSpec("positive_int", "memory"),
    "max_prefill_tokens": SettingSpec("positive_int", "memory, the runtime's conductor"),
    "cuda_graphs": SettingSpec("bool", "cuda-graphs, memory"),
    "graph_max_tokens": SettingSpec("positive_int", "cuda-graphs, memory (the plan's buckets)"),
    "stream_capacity": SettingSpec("positive_int", "streams", hi=MAX_STREAM_ITEMS),
    "max_batch": SettingSpec("positive_int", "the runtime's conductor"),
    "checkpoint_subdir": SettingSpec("str", "the runtime's weight loader"),
}

TAG_ARGS: dict[str, SettingSpec] = {"max_len": SettingSpec("positive_int", "memory")}

_KIND_WORDS = {"positive_int": "a positive integer", "bool": "true or false", "str": "a string",
               "dtype": f"one of {', '.join(I.DTYPE_BYTES)}"}


def setting_problem(spec: SettingSpec, value: I.ConfigValue) -> str | None:
    """What is wrong with a setting's value, as the end of a sentence ("must be ..."), or None."""
    ok = {"positive_int": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
          "bool": lambda v: isinstance(v, bool),
          "str": lambda v: isinstance(v, str),
          "dtype": lambda v: v in I.DTYPE_BYTES}[spec.kind](value)
    if not ok:
        return f"must be {_KIND_WORDS[spec.kind]}"
    if spec.hi is not None and isinstance(value, int) and value > spec.hi:
        return f"must be at most {spec.hi} (the plan's bound)"
    return None


def closest(name: str, known: list[str]) -> str | None:
    """The known name most like `name` (a typo), for a hint."""
    found = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return found[0] if found else None
