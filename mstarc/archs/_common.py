"""Shared machinery of the architecture catalogue: argument checking and tensor building.

`parse_args` validates an `arch` line's keyword arguments against a small schema (missing,
unknown and ill-typed arguments become `ArchError`s naming the argument). `Tensors` collects
`TensorSpec`s with the naming/shape conventions of PyTorch modules (Linear weight is
[out, in], Conv weight is [out, in / groups, *kernel], ConvTranspose is [in, out, *kernel]),
and the `decoder_*` helpers emit the Llama/Qwen-style attention and SwiGLU blocks that
several families share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstarc.archs.spec import SHARD_ROLES, WEIGHT_DTYPES, ArchError, ArchSpec, KVGeometry, TensorSpec
from mstarc.limits import MAX_ARCH_TENSORS

_REQUIRED = object()


@dataclass(frozen=True)
class Arg:
    """One keyword argument of an arch: its kind and, if optional, its default."""

    kind: str  # "int" | "bool" | "float" | "ints" (a non-empty list of ints)
    default: Any = _REQUIRED
    minimum: int = 1  # for "int" and each item of "ints"
    allow_empty: bool = False  # for "ints"


def INT(default: Any = _REQUIRED, minimum: int = 1) -> Arg:  # noqa: N802 - schema constructors read as types
    return Arg("int", default, minimum)


def BOOL(default: Any = _REQUIRED) -> Arg:  # noqa: N802
    return Arg("bool", default)


def INTS(default: Any = _REQUIRED, minimum: int = 1, allow_empty: bool = False) -> Arg:  # noqa: N802
    return Arg("ints", default, minimum, allow_empty)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is an int in Python; not here


def _check(name: str, spec: Arg, value: Any) -> Any:
    if spec.kind == "int":
        if not _is_int(value) or value < spec.minimum:
            raise ArchError(f"argument '{name}' must be an integer >= {spec.minimum}, got {value!r}", name)
        return value
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise ArchError(f"argument '{name}' must be true or false, got {value!r}", name)
        return value
    if spec.kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ArchError(f"argument '{name}' must be a number, got {value!r}", name)
        return float(value)
    if spec.kind == "ints":
        if not isinstance(value, list | tuple) or not all(_is_int(v) and v >= spec.minimum for v in value):
            raise ArchError(f"argument '{name}' must be a list of integers >= {spec.minimum}, got {value!r}", name)
        if not value and not spec.allow_empty:
            raise ArchError(f"argument '{name}' must not be empty", name)
        return tuple(value)
    raise AssertionError(f"unknown argument kind {spec.kind!r}")  # pragma: no cover - schema bug


def parse_args(arch: str, args: Mapping[str, Any], schema: Mapping[str, Arg]) -> dict[str, Any]:
    """Check `args` against `schema`: every required argument present, no unknown ones,
    every value of the right kind. Returns the values with defaults filled in."""
    for name in args:
        if name not in schema:
            raise ArchError(f"{arch}() has no argument '{name}' (it takes: {', '.join(schema)})", name)
    out: dict[str, Any] = {}
    for name, spec in schema.items():
        if name in args:
            out[name] = _check(name, spec, args[name])
        elif spec.default is _REQUIRED:
            raise ArchError(f"{arch}() is missing argument '{name}'", name)
        else:
            out[name] = spec.default
    return out


def check_dtype(dtype: str) -> str:
    if dtype not in WEIGHT_DTYPES:
        raise ArchError(f"weights dtype must be one of {', '.join(WEIGHT_DTYPES)}, not {dtype!r}")
    return dtype


def require(cond: bool, message: str, arg: str) -> None:
    """A cross-argument constraint (e.g. heads divisible by kv_heads), blamed on `arg`."""
    if not cond:
        raise ArchError(message, arg)


class Tensors:
    """An ordered, duplicate-free list of TensorSpecs in one dtype."""

    def __init__(self, dtype: str):
        self.dtype = check_dtype(dtype)
        self._items: dict[str, TensorSpec] = {}

    def add(self, name: str, shape: tuple[int, ...], shard: str = "replicate") -> None:
        assert shard in SHARD_ROLES, shard
        assert name not in self._items, f"duplicate tensor {name}"  # a catalogue bug, not user error
        if len(self._items) >= MAX_ARCH_TENSORS:  # a layer or expert count far beyond any model
            raise ArchError(f"the architecture would have more than {MAX_ARCH_TENSORS} weight tensors",
                            None)
        self._items[name] = TensorSpec(name, tuple(shape), self.dtype, shard)

    def linear(self, prefix: str, out_f: int, in_f: int, bias: bool = True, shard: str = "replicate") -> None:
        self.add(f"{prefix}.weight", (out_f, in_f), shard)
        if bias:
            # a column-split layer's bias is split with it; a row-split layer adds its bias
            # once after the all-reduce, so it stays whole
            self.add(f"{prefix}.bias", (out_f,), shard if shard in ("col", "expert") else "replicate")

    def norm(self, prefix: str, dim: int, bias: bool = False) -> None:
        self.add(f"{prefix}.weight", (dim,))
        if bias:
            self.add(f"{prefix}.bias", (dim,))

    def conv(self, prefix: str, out_c: int, in_per_group: int, kernel: tuple[int, ...], bias: bool = True) -> None:
        self.add(f"{prefix}.weight", (out_c, in_per_group, *kernel))
        if bias:
            self.add(f"{prefix}.bias", (out_c,))

    def conv_transpose(self, prefix: str, in_c: int, out_c: int, kernel: tuple[int, ...], bias: bool = True) -> None:
        self.add(f"{prefix}.weight", (in_c, out_c, *kernel))
        if bias:
            self.add(f"{prefix}.bias", (out_c,))

    def spec(self, dims: Mapping[str, int], kv: KVGeometry | None) -> ArchSpec:
        return ArchSpec(tuple(self._items.values()), dict(dims), kv)


def decoder_attention(t: Tensors, prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, *,
                      qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False,
                      suffix: str = "") -> None:
    """q/k/v/o projections of a GQA decoder layer (`suffix` names a MoT expert copy)."""
    t.linear(f"{prefix}.q_proj{suffix}", heads * head_dim, hidden, qkv_bias, "col")
    t.linear(f"{prefix}.k_proj{suffix}", kv_heads * head_dim, hidden, qkv_bias, "col")
    t.linear(f"{prefix}.v_proj{suffix}", kv_heads * head_dim, hidden, qkv_bias, "col")
    t.linear(f"{prefix}.o_proj{suffix}", hidden, heads * head_dim, o_bias, "row")
    if qk_norm:  # RMSNorm over head_dim, shared by all heads: every rank needs all of it
        t.norm(f"{prefix}.q_norm{suffix}", head_dim)
        t.norm(f"{prefix}.k_norm{suffix}", head_dim)


def swiglu(t: Tensors, prefix: str, hidden: int, intermediate: int, shard: tuple[str, str] = ("col", "row")) -> None:
    """gate/up/down projections, no bias (Llama, Qwen, their MoE experts)."""
    t.linear(f"{prefix}.gate_proj", intermediate, hidden, False, shard[0])
    t.linear(f"{prefix}.up_proj", intermediate, hidden, False, shard[0])
    t.linear(f"{prefix}.down_proj", hidden, intermediate, False, shard[1])


def encoder_attention(t: Tensors, prefix: str, dim: int) -> None:
    """q/k/v/out projections with bias of a ViT / Whisper-style encoder layer (SigLIP, Qwen3-Omni's audio tower)."""
    for proj in ("q_proj", "k_proj", "v_proj"):
        t.linear(f"{prefix}.{proj}", dim, dim, True, "col")
    t.linear(f"{prefix}.out_proj", dim, dim, True, "row")


def gelu_mlp(t: Tensors, prefix: str, dim: int, ffn: int) -> None:
    """fc1 / fc2 with bias of an encoder layer's MLP (`prefix` "" for fc1 / fc2 at the layer's top level)."""
    t.linear(f"{prefix}fc1", ffn, dim, True, "col")
    t.linear(f"{prefix}fc2", dim, ffn, True, "row")


def encoder_layers(t: Tensors, prefix: str, layers: int, dim: int, ffn: int, norms: tuple[str, str],
                   mlp: str) -> None:
    """`layers` ViT / Whisper-style encoder layers `{prefix}.{i}`, each its self-attention,
    the bias norm `norms[0]`, its GELU MLP (under `mlp`: "mlp.", or "" for fc1 / fc2 at the
    layer's top level) and the bias norm `norms[1]`, in that order (BAGEL's SigLIP,
    Qwen3-Omni's audio tower)."""
    for i in range(layers):
        p = f"{prefix}.{i}"
        encoder_attention(t, f"{p}.self_attn", dim)
        t.norm(f"{p}.{norms[0]}", dim, bias=True)
        gelu_mlp(t, f"{p}.{mlp}", dim, ffn)
        t.norm(f"{p}.{norms[1]}", dim, bias=True)


def encoder_dims(layers: int, dim: int, heads: int, ffn: int) -> dict[str, int]:
    """The dims of an encoder arch (full attention, no KV): its head_dim is dim / heads."""
    return {"layers": layers, "hidden": dim, "heads": heads, "head_dim": dim // heads, "intermediate": ffn}


def gqa_checks(heads: int, kv_heads: int) -> None:
    require(heads % kv_heads == 0, f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})", "kv_heads")


# The sizes of a stack of GQA decoder layers, and of every GQA decoder arch: those and its
# vocabulary (Llama, BAGEL's MoT, π0.5's Gemma; Qwen3-Omni's add their own).
LAYER_ARGS: dict[str, Arg] = {"layers": INT(), "hidden": INT(), "heads": INT(), "kv_heads": INT(),
                              "head_dim": INT(), "intermediate": INT()}
DECODER_ARGS: dict[str, Arg] = {**LAYER_ARGS, "vocab": INT()}
_DECODER_DIMS = ("layers", "hidden", "heads", "kv_heads", "head_dim")


def decoder_args(arch: str, args: Mapping[str, Any], schema: Mapping[str, Arg]) -> dict[str, Any]:
    """`parse_args` of a GQA decoder arch, with heads a multiple of kv_heads."""
    a = parse_args(arch, args, schema)
    gqa_checks(a["heads"], a["kv_heads"])
    return a


def decoder_dims(a: Mapping[str, Any], **extra: int) -> dict[str, int]:
    """A decoder's `dims`: layers, hidden, heads, kv_heads, head_dim, then `extra`."""
    return {**{k: a[k] for k in _DECODER_DIMS}, **extra}


def decoder_spec(t: Tensors, a: Mapping[str, Any], **extra: int) -> ArchSpec:
    """The spec of a decoder whose every layer keeps one K/V entry per token (`decoder_dims` as its dims)."""
    return t.spec(decoder_dims(a, **extra), KVGeometry(a["layers"], a["kv_heads"], a["head_dim"]))
