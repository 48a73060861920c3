"""The wire codec of the typed messages (worker/messages.py declares them): msgpack, schema-checked.

A message is a frozen dataclass with a ``type`` tag; on the wire it is one msgpack map
``{"type": tag, <field>: <value>, ...}``. Only the classes `register`ed here (messages.py
registers its allowlist at import) are ever encoded or built: ``decode`` checks every field
against the dataclass annotations (exact field set, exact types, nested structs), so a peer
can never make us build an arbitrary object; no pickle anywhere. Any malformed input,
truncated or bit-flipped, raises ``MessageError``. Small tensors ride inline as
``{dtype, shape, data}`` (raw little-endian bytes, at most ``MAX_INLINE_TENSOR_BYTES``);
Python scalars as msgpack's own bool, int, float, str and nil (``Scalar``).

A converter per annotation is compiled on first use (the fast path below); a value it
declines goes through the schema-directed walk, which gives the precise error.
"""

import dataclasses
import math
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any, get_args, get_origin

import msgpack
import torch

MAX_MESSAGE_BYTES = 64 << 20
MAX_INLINE_TENSOR_BYTES = 4 << 20
MAX_TENSOR_DIMS = 8

# Explicit allowlist of dtypes a message may carry, by wire name.
TENSOR_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_DTYPE_NAMES = {dt: name for name, dt in TENSOR_DTYPES.items()}

# A Python value that rides inside a message as itself (a node's `int`, `float`, `bool`
# or `str` port, or an absent optional value).
Scalar = bool | int | float | str | None
_PRIMITIVES = (bool, int, float, str, bytes)


class MessageError(ValueError):
    """A message that cannot be encoded or decoded: unknown type, bad field, corrupt bytes."""


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of an allowlisted dtype; a MessageError for any other."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise MessageError(f"dtype {dtype} cannot travel between ranks")
    return name




# ------------------------------------------------------------------ the allowlists (register)
MESSAGE_TYPES: dict[str, type] = {}  # the only classes decode will ever instantiate, by tag
STRUCT_TYPES: set[type] = set()  # the dataclasses that may nest inside them
_SCHEMAS: dict[type, dict[str, Any]] = {}


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def register(messages: Iterable[type], structs: Iterable[type]) -> None:
    """Allow `messages` (each with a ``type`` tag) on the wire, and `structs` inside them."""
    messages, structs = tuple(messages), tuple(structs)
    for cls in messages:
        MESSAGE_TYPES[cls.type] = cls  # type: ignore[attr-defined]
    STRUCT_TYPES.update(structs)
    for cls in (*messages, *structs):
        _SCHEMAS[cls] = _field_types(cls)


# ------------------------------------------------------------------------------- tensors
def _tensor_to_wire(t: torch.Tensor, path: str) -> dict[str, Any]:
    if t.dtype not in _DTYPE_NAMES:
        raise MessageError(f"{path}: dtype {t.dtype} cannot travel in a message")
    if t.dim() > MAX_TENSOR_DIMS:
        raise MessageError(f"{path}: {t.dim()} dims is over the limit of {MAX_TENSOR_DIMS}")
    nbytes = t.numel() * t.element_size()
    if nbytes > MAX_INLINE_TENSOR_BYTES:
        raise MessageError(f"{path}: {nbytes} bytes is too big to inline; send it over torch.distributed")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return {
        "dtype": _DTYPE_NAMES[t.dtype],
        "shape": list(t.shape),
        "data": flat.view(torch.uint8).numpy().tobytes(),
    }


def _tensor_from_wire(value: Any, path: str) -> torch.Tensor:
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data"}:
        raise MessageError(f"{path}: a tensor must be a map with exactly dtype, shape, data")
    dtype = TENSOR_DTYPES.get(value["dtype"]) if isinstance(value["dtype"], str) else None
    shape, data = value["shape"], value["data"]
    if dtype is None:
        raise MessageError(f"{path}: unsupported tensor dtype {value['dtype']!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_TENSOR_DIMS
        or not all(_is_int(d) and d >= 0 for d in shape)
    ):
        raise MessageError(f"{path}: bad tensor shape {shape!r}")
    if not isinstance(data, bytes):
        raise MessageError(f"{path}: tensor data must be bytes")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(shape) * itemsize != len(data):
        raise MessageError(f"{path}: {len(data)} data bytes do not match shape {shape} of {value['dtype']}")
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


# ------------------------------------------------------------------ schema-directed walk
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    if isinstance(tp, types.UnionType) or get_origin(tp) is typing.Union:
        return get_args(tp)
    return None


# annotation -> (its union, if it is one: (options but None, None allowed, all primitives);
# generic origin; generic args), worked out once per annotation, not once per value (a
# step's message holds thousands of values)
_Union = tuple[tuple[Any, ...], bool, bool]
_ANNOTATIONS: dict[Any, tuple[_Union | None, Any, tuple[Any, ...]]] = {}
# list items whose values are checked by exact type in one pass (int excludes bool, as _is_int)
_EXACT_ITEMS = frozenset({int, float, str, bytes, bool})


def _annotation(tp: Any) -> tuple[_Union | None, Any, tuple[Any, ...]]:
    info = _ANNOTATIONS.get(tp)
    if info is None:
        union = None
        if (options := _union_args(tp)) is not None:
            inner = tuple(o for o in options if o is not type(None))
            union = (inner, type(None) in options, len(inner) > 1 and all(o in _PRIMITIVES for o in inner))
        info = _ANNOTATIONS[tp] = (union, get_origin(tp), get_args(tp))
    return info


def _convert(value: Any, tp: Any, path: str, to_wire: bool) -> Any:
    """Check ``value`` against annotation ``tp`` and convert it to (or from) its wire form."""
    union, origin, args = _annotation(tp)
    if union is not None:
        inner, nullable, primitives = union
        if value is None and nullable:
            return None
        if primitives:
            return _convert_primitive_union(value, inner, path)
        if len(inner) != 1:  # else only ``X | None``: keep decoding unambiguous
            raise MessageError(f"{path}: unsupported union annotation {tp}")
        return _convert(value, inner[0], path, to_wire)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if _is_int(value):
            return value
    elif tp is float:
        if isinstance(value, float) or _is_int(value):
            return float(value)
    elif tp is str or tp is bytes:
        if isinstance(value, tp):
            return value
    elif tp is torch.Tensor:
        if to_wire and isinstance(value, torch.Tensor):
            return _tensor_to_wire(value, path)
        if not to_wire:
            return _tensor_from_wire(value, path)
    elif origin is list or origin is tuple:
        # a tuple[X, ...] (an engine record's field) travels as a msgpack array, as a list does
        if isinstance(value, list) or (to_wire and origin is tuple and isinstance(value, tuple)):
            item = _item_type(tp, origin, args, path)
            if item in _EXACT_ITEMS and all(type(v) is item for v in value):
                items = list(value)  # page tables, slot lists: no per-item walk (or path string)
            else:
                items = [_convert(v, item, f"{path}[{i}]", to_wire) for i, v in enumerate(value)]
            return tuple(items) if origin is tuple and not to_wire else items
    elif origin is dict:
        if isinstance(value, dict):
            key_tp, val_tp = args
            if key_tp is not str:
                raise MessageError(f"{path}: only str-keyed maps are supported")
            if not all(isinstance(k, str) for k in value):
                raise MessageError(f"{path}: map keys must be strings")
            return {k: _convert(v, val_tp, f"{path}.{k}", to_wire) for k, v in value.items()}
    elif tp in STRUCT_TYPES:
        if to_wire and isinstance(value, tp):
            return _fields_to_wire(value, path)
        if not to_wire and isinstance(value, dict):
            return tp(**_fields_from_wire(tp, value, path))
    else:
        raise MessageError(f"{path}: unsupported annotation {tp}")
    raise MessageError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__}")


def _item_type(tp: Any, origin: Any, args: tuple[Any, ...], path: str) -> Any:
    """The item annotation of ``list[X]`` or ``tuple[X, ...]``; fixed-length tuples do not travel."""
    if origin is list:
        return args[0]
    if len(args) != 2 or args[1] is not Ellipsis:
        raise MessageError(f"{path}: unsupported annotation {tp} (only tuple[X, ...])")
    return args[0]


def _convert_primitive_union(value: Any, options: Sequence[Any], path: str) -> Any:
    """A value of a union of msgpack primitives (``Scalar``): its own type must be one of the
    options, exactly (no int -> float widening, no bool as int), so encode and decode agree."""
    for tp in options:
        if tp is bool and isinstance(value, bool):
            return value
        if tp is int and _is_int(value):
            return int(value)
        if tp is float and isinstance(value, float):
            return float(value)
        if tp in (str, bytes) and isinstance(value, tp):
            return value
    names = " | ".join(_type_name(o) for o in options)
    raise MessageError(f"{path}: expected {names}, got {type(value).__name__}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _fields_to_wire(obj: Any, path: str) -> dict[str, Any]:
    return {
        name: _convert(getattr(obj, name), tp, f"{path}.{name}", to_wire=True)
        for name, tp in _SCHEMAS[type(obj)].items()
    }


def _fields_from_wire(cls: type, wire: dict[str, Any], path: str) -> dict[str, Any]:
    schema = _SCHEMAS[cls]
    missing = [n for n in schema if n not in wire]
    extra = sorted(str(k) for k in wire if k not in schema)
    if missing or extra:
        raise MessageError(
            f"{path}: {cls.__name__}"
            + (f" is missing {', '.join(missing)}" if missing else "")
            + (f" has unexpected {', '.join(extra)}" if extra else "")
        )
    return {name: _convert(wire[name], tp, f"{path}.{name}", to_wire=False) for name, tp in schema.items()}


# ------------------------------------------------------------------ compiled fast path
# The walk above builds a path string for every value it visits, so that an error names the
# exact place; a 64-entry decode step holds ~1,200 values. Each annotation also gets a
# compiled converter (closures, no paths) that accepts exactly what the walk accepts or
# less, and raises on anything else; `encode` and `decode` try it first and, when it
# declines, run the walk, which then raises the precise error (or, for a value the fast
# path is stricter about, such as a str subclass, converts it).
class _Decline(Exception):
    """The fast path does not take this value; the walk decides."""


_FAST: dict[tuple[Any, bool], Any] = {}


def _fast(tp: Any, to_wire: bool) -> Any:
    key = (tp, to_wire)
    conv = _FAST.get(key)
    if conv is None:
        conv = _FAST[key] = _build_fast(tp, to_wire)
    return conv


def _decline(value: Any) -> Any:
    raise _Decline


def _exact(tp: type) -> Any:
    def conv(value: Any) -> Any:
        if type(value) is tp:
            return value
        raise _Decline

    return conv


def _to_float(value: Any) -> float:
    t = type(value)
    if t is float:
        return value
    if t is int:
        return float(value)
    raise _Decline


def _build_fast(tp: Any, to_wire: bool) -> Any:  # noqa: C901 - one branch per annotation kind
    union, origin, args = _annotation(tp)
    if union is not None:
        inner, nullable, primitives = union
        if primitives:
            return lambda v: None if v is None and nullable else _convert_primitive_union(v, inner, "")
        if len(inner) != 1:
            return _decline
        sub = _fast(inner[0], to_wire)
        return (lambda v: None if v is None else sub(v)) if nullable else sub
    if tp in (bool, int, str, bytes):
        return _exact(tp)
    if tp is float:
        return _to_float
    if tp is torch.Tensor:
        if to_wire:
            return lambda v: _tensor_to_wire(v, "") if isinstance(v, torch.Tensor) else _decline(v)
        return lambda v: _tensor_from_wire(v, "")
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        item = args[0]
        sub = _fast(item, to_wire)
        exact = item in _EXACT_ITEMS
        # on the wire an array; in Python a list, or a tuple for a tuple[X, ...] field
        accepted = (list, tuple) if to_wire and origin is tuple else (list,)
        made = tuple if origin is tuple and not to_wire else list

        def convert_list(value: Any) -> Any:
            if type(value) not in accepted:
                raise _Decline
            if exact and all(type(v) is item for v in value):
                return made(value)
            return made([sub(v) for v in value])

        return convert_list
    if origin is dict:
        key_tp, val_tp = args
        if key_tp is not str:
            return _decline
        sub = _fast(val_tp, to_wire)

        def convert_dict(value: Any) -> dict[str, Any]:
            if type(value) is not dict or not all(type(k) is str for k in value):
                raise _Decline
            return {k: sub(v) for k, v in value.items()}

        return convert_dict
    if tp in _SCHEMAS:
        return _build_struct(tp, to_wire)
    return _decline


def _build_struct(cls: type, to_wire: bool) -> Any:
    schema = _SCHEMAS[cls]  # in dataclass field order: the positional order of cls(...)
    pairs = tuple((name, _fast(tp, to_wire)) for name, tp in schema.items())
    names = frozenset(schema)
    if to_wire:
        return lambda v: {n: c(getattr(v, n)) for n, c in pairs} if type(v) is cls else _decline(v)

    def from_wire(value: Any) -> Any:
        if type(value) is not dict or value.keys() != names:
            raise _Decline
        return cls(*[c(value[n]) for n, c in pairs])

    return from_wire


# ------------------------------------------------------------------------------ public API
def encode(msg: Any) -> bytes:
    """msgpack bytes of an allowlisted message; fields are checked as strictly as on decode."""
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "type", None)) is not cls:
        raise MessageError(f"{cls.__name__} is not an allowlisted message type")
    try:
        fields = _fast(cls, True)(msg)
    except Exception:  # noqa: BLE001 - the walk below is the authority, and names the place
        fields = _fields_to_wire(msg, cls.type)
    wire = {"type": cls.type, **fields}
    try:
        data = msgpack.packb(wire, use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as exc:  # e.g. an int beyond 64 bits
        raise MessageError(f"{cls.type}: cannot encode: {exc}") from exc
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(
            f"{cls.type}: {len(data)} bytes is over the {MAX_MESSAGE_BYTES}-byte message limit"
        )
    return data


def decode(data: bytes | bytearray | memoryview) -> Any:
    """The message in ``data``; raises ``MessageError`` for anything but a well-formed,
    allowlisted message."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MessageError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"{len(data)} bytes is over the {MAX_MESSAGE_BYTES}-byte message limit")
    try:
        # strict_map_key: only str/bytes keys; ext types and timestamps are rejected by the schema.
        wire = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many unrelated types for corrupt input
        raise MessageError(f"corrupt message: {type(exc).__name__}: {exc}") from exc
    if not isinstance(wire, dict):
        raise MessageError(f"a message must be a map, got {type(wire).__name__}")
    tag = wire.pop("type", None)
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {tag!r}; allowed: {', '.join(MESSAGE_TYPES)}")
    try:
        return _fast(cls, False)(wire)  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - the walk below is the authority, and names the place
        return cls(**_fields_from_wire(cls, wire, tag))
