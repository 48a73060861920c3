"""Node instances from a plan, and their weights: random (`dummy`), the node's own init, or safetensors.

`build_node` imports a node's `impl` class (only from the `mstar_models` package: a plan names
code, and code outside the model corpus is never imported on a plan's say-so) and builds it
from the `NodeSpec` the plan implies. `load_weights` fills its parameters:

- `"dummy"` (alias `"random"`): deterministic random weights for benchmarks. Each tensor has
  its own generator, seeded from a hash of (node, tensor name), so a value never depends on
  the other tensors or on the global RNG; under tensor parallelism each rank draws the full
  tensor and keeps its slice, so tp N holds the values of tp 1. The generator lives on the
  parameter's device, so the values are reproducible per device type (CPU and CUDA give
  different ones). Rule:
  matrices ~ N(0, 0.02); conv kernels (3+ dims) ~ N(0, 1/sqrt(fan_in)); 1-D tensors whose name contains "norm" (and is not
  a bias) = 1 (norm gains); every other 1-D or 0-D tensor = 0 (biases, gates).
- `"init"`: keep what the constructor made (nodes that seed themselves, e.g. the test family).
- a folder: `model.safetensors.index.json` shards, else every `*.safetensors` file in it,
  read lazily with `safe_open` (never pickle). Checked before anything is copied:
  every file the plan was compiled against still has the same header hash; every tensor of
  the node's arch exists with its exact (full) shape; every module tensor is found; no tensor
  that starts with the node's checkpoint prefix is left unclaimed by every node of the plan
  (except those a node class of the plan lists in `unused_checkpoint_tensors:
  ClassVar[tuple[str, ...]]`: tensors a released file holds that the model never reads, e.g.
  π0.5's language heads).
  Then each tensor is copied into its parameter (narrowed to this rank's shard under tensor
  parallelism), which is `load_state_dict(strict=True)` without holding a second copy of
  the weights in memory.

Names. The arch lists tensors by their checkpoint names. A module's state-dict name `n`
maps to the checkpoint name `node.rename(n)` when the class defines `rename`, else
`checkpoint_prefix + n` (`checkpoint_prefix: ClassVar[str]`, default ""). Every arch tensor
must be a module tensor; a module tensor outside the arch (glue the arch catalogue does not
describe) must be in the checkpoint, with the module's shape. Tied parameters (one
Parameter under two names) are loaded once, by their first name.

Sub-folders. A node's `checkpoint_subdir` setting in the `.walk` (or, failing that, a
`checkpoint_subdir: ClassVar[str]` on its class) names a second checkpoint beside the main
one (Orpheus' SNAC codec): when the source is a folder, that node's tensors are read from
`folder / checkpoint_subdir`, with every check above. The compiler scans sub-folders too and
lists their files as `<subdir>/<file>`; each folder is hash-checked against its own files.

FP8. When the plan's node has `quantized` (a placement's `weights: fp8`; feature
`fp8_weights`), the weights are first filled as above in the checkpoint's dtype, from any
source, and then `module.quantize_weights("fp8")` turns them into E4M3 with per-channel
scales (`mstar_models.layers.fp8`): the checkpoint and its names are unchanged, the
quantization is a load-time transform. A class without `quantize_weights` is refused, and
so is one whose E4M3 tensors afterwards are not exactly the plan's `quantized.tensors`
(the memory the plan was sized for).

Hook. After a folder's tensors are copied, `load_weights` calls `module.on_weights(source)`
(the weights source as given, a string) when the node's class defines `on_weights`: a node
that needs other files of the checkpoint reads them there (Orpheus' PromptBuilder takes the
checkpoint's `tokenizer.json`). Not called for `dummy` or `init`, which have no files.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from mstar_runtime import safetensors_header
from mstar_runtime.ops.node import KVNode, NodeError, StatelessNode
from mstar_runtime.plan.loader import Plan, PlanError, PlanNode

MODELS_PACKAGE = "mstar_models"
DUMMY_SOURCES = ("dummy", "random")
INIT_SOURCE = "init"
INDEX_FILE = "model.safetensors.index.json"


class WeightsError(NodeError):
    """Weights that do not fit the plan: the message names the node, the tensor and the file."""


# ------------------------------------------------------------------------------- building
def build_node(
    plan: Plan,
    name: str,
    rank: int,
    device: torch.device | str,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    tp_group: Any = None,
) -> StatelessNode | KVNode:
    """An instance of node `name` for `rank`, on `device`, in eval mode with gradients off."""
    info = plan.node(name)
    if rank not in info.ranks:
        raise PlanError(
            plan.path, f"node '{name}' is not placed on rank {rank} (its ranks: {list(info.ranks)})"
        )
    cls = _import_impl(plan, info)
    spec = plan.node_spec(name, device=device, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
    try:
        module = cls(spec)
    except NodeError:
        raise
    except Exception as e:
        raise NodeError(f"node '{name}' ({info.impl}) cannot be built: {type(e).__name__}: {e}") from e
    # A node should create its tensors on spec.device; moving is the fallback that keeps a
    # node written for one device usable on another.
    module.to(spec.device)
    module.eval()
    module.requires_grad_(False)
    return module


def _import_impl(plan: Plan, info: PlanNode) -> type[StatelessNode] | type[KVNode]:
    module_name, _, cls_name = info.impl.rpartition(".")
    if not module_name.startswith(MODELS_PACKAGE + ".") or not cls_name:
        raise PlanError(
            plan.path,
            f"node '{info.name}': impl '{info.impl}' is not a class under the "
            f"'{MODELS_PACKAGE}' package; a plan may only name model code",
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PlanError(
            plan.path, f"node '{info.name}': cannot import '{module_name}' for impl '{info.impl}': {e}"
        ) from e
    cls = getattr(module, cls_name, None)
    base = KVNode if info.engine == "kv" else StatelessNode
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PlanError(
            plan.path,
            f"node '{info.name}': impl '{info.impl}' is not a {base.__name__} "
            f"subclass, as a {info.engine} node needs",
        )
    return cls


# -------------------------------------------------------------------------------- naming
def checkpoint_name(module: nn.Module, name: str) -> str:
    """The checkpoint (and arch) name of the module's state-dict entry `name`."""
    rename = getattr(type(module), "rename", None)
    if callable(rename):
        return str(module.rename(name))  # type: ignore[operator]
    return str(getattr(module, "checkpoint_prefix", "")) + name


def _module_tensors(module: nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    """checkpoint name -> (tensor, is_parameter); tied parameters appear once."""
    out: dict[str, tuple[torch.Tensor, bool]] = {}
    seen: set[int] = set()
    params = {id(p) for p in module.parameters()}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[checkpoint_name(module, name)] = (t, id(t) in params)
    return out


def _shard_slices(
    plan: Plan, node: str, tensor: str, shape: tuple[int, ...], tp_rank: int, tp_size: int
) -> tuple[slice, ...]:
    """This rank's slice of a full tensor (whole unless the plan splits it)."""
    info = plan.node(node)
    split = info.shard.splits.get(tensor) if info.shard is not None else None
    if split is None or split.dim is None or split.parts <= 1 or tp_size <= 1:
        return tuple(slice(None) for _ in shape)
    # parts < tp_size replicates each part over tp_size / parts ranks (KV heads).
    part = tp_rank * split.parts // tp_size
    size = shape[split.dim] // split.parts
    return tuple(
        slice(part * size, (part + 1) * size) if d == split.dim else slice(None) for d in range(len(shape))
    )


def _sliced_shape(shape: tuple[int, ...], slices: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for n, s in zip(shape, slices, strict=True))


# ------------------------------------------------------------------------------- loading
def load_weights(module: nn.Module, plan: Plan, node: str, source: str | Path) -> None:
    """Fill `module` (an instance of plan node `node`) from `source`, then quantize what the
    plan's `quantized` names; see the module docstring."""
    _fill_weights(module, plan, node, source)
    info = plan.node(node)
    if info.weights_format is not None:
        quantize_node(module, node, info.weights_format, info.quantized_tensors)


def quantize_node(module: nn.Module, node: str, fmt: str, expected: Iterable[str]) -> None:
    """The load-time transform of the plan's `quantized`: the node's own `quantize_weights`,
    then a check that the E4M3 tensors (by checkpoint name) are the plan's list."""
    if fmt != "fp8_e4m3":
        raise WeightsError(f"node '{node}': unknown weights format '{fmt}' in the plan (known: fp8_e4m3)")
    if not callable(getattr(type(module), "quantize_weights", None)):
        raise WeightsError(f"node '{node}' ({type(module).__name__}) cannot hold FP8 weights: its class has no "
                           "quantize_weights; compile it without `weights: fp8` in the placement")
    with torch.no_grad():
        try:
            module.quantize_weights("fp8")  # type: ignore[operator]
        except (TypeError, ValueError) as e:
            raise WeightsError(f"node '{node}' ({type(module).__name__}) cannot hold FP8 weights: {e}") from e
    got = {name for name, (t, _) in _module_tensors(module).items() if t.dtype == torch.float8_e4m3fn}
    want = set(expected)
    if got != want:
        diff = sorted(got ^ want)
        raise WeightsError(f"node '{node}' ({type(module).__name__}) quantized {len(got)} tensors to FP8 where the "
                           f"plan names {len(want)} (first difference: '{diff[0]}'): its memory was sized for the "
                           "plan's list")


def _fill_weights(module: nn.Module, plan: Plan, node: str, source: str | Path) -> None:
    info = plan.node(node)
    tensors = _module_tensors(module)
    spec = getattr(module, "spec", None)
    tp_rank, tp_size = (spec.tp_rank, spec.tp_size) if spec is not None else (0, 1)
    _check_arch_names(plan, node, tensors, tp_rank, tp_size)
    src = str(source)
    if src == INIT_SOURCE:
        return
    if src in DUMMY_SOURCES:
        _dummy_init(plan, node, tensors, tp_rank, tp_size)
        return
    subdir = str(plan.node(node).settings.get("checkpoint_subdir") or getattr(type(module), "checkpoint_subdir", ""))
    folder = Path(src) / subdir if subdir else Path(src)
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise WeightsError(f"node '{node}': weights folder '{folder}' {what} (use 'dummy' for random weights)")
    checkpoint = Checkpoint.open(folder)
    checkpoint.verify_against(plan, subdir)
    arch = {t.name: t.shape for t in info.arch.tensors} if info.arch is not None else {}
    plan_claims = {t.name for n in plan.nodes.values() if n.arch is not None for t in n.arch.tensors}
    plan_claims |= set(tensors)
    prefix = _node_prefix(module, arch or tensors)
    unused = {t for info_n in plan.nodes.values()
              for t in getattr(_import_impl(plan, info_n), "unused_checkpoint_tensors", ())}
    extra = sorted(t for t in checkpoint.files_of if t.startswith(prefix) and t not in plan_claims and t not in unused)
    if extra:
        raise WeightsError(
            f"node '{node}': checkpoint tensor '{extra[0]}' in '{checkpoint.files_of[extra[0]]}' "
            f"is not a tensor of this node or of any node of the plan"
            + (f" ({len(extra) - 1} more)" if len(extra) > 1 else "")
        )
    plan_jobs: list[tuple[str, torch.Tensor, tuple[slice, ...]]] = []
    for cname, (target, is_param) in tensors.items():
        if cname not in checkpoint.files_of:
            if is_param or cname in arch:
                raise WeightsError(
                    f"node '{node}': tensor '{cname}' is missing from the checkpoint in '{folder}'"
                    f" (files: {', '.join(checkpoint.file_names) or 'none'})"
                )
            continue  # a buffer the checkpoint does not hold keeps its computed value
        full = checkpoint.shape(cname)
        expected = arch.get(cname)
        if expected is not None and full != expected:
            raise WeightsError(
                f"node '{node}': tensor '{cname}' in '{checkpoint.files_of[cname]}' has shape "
                f"{list(full)}; the plan expects {list(expected)}"
            )
        slices = _shard_slices(plan, node, cname, full, tp_rank, tp_size)
        if _sliced_shape(full, slices) != tuple(target.shape):
            raise WeightsError(
                f"node '{node}': tensor '{cname}' in '{checkpoint.files_of[cname]}' has shape "
                f"{list(full)}, which does not give the module's {list(target.shape)} "
                f"(tp rank {tp_rank} of {tp_size})"
            )
        plan_jobs.append((cname, target, slices))
    with torch.no_grad():
        for cname, target, slices in plan_jobs:
            target.copy_(checkpoint.read(cname, slices))
    if callable(getattr(type(module), "on_weights", None)):  # the hook of the module docstring
        module.on_weights(src)  # type: ignore[operator]


def _node_prefix(module: nn.Module, names: Iterable[str]) -> str:
    """`checkpoint_prefix`, else the dotted prefix all of the node's tensor names share ("" if none):
    the part of the checkpoint's name space this node answers for."""
    declared = str(getattr(module, "checkpoint_prefix", ""))
    if declared:
        return declared
    parts = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for level in zip(*parts) if parts else ():
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return "".join(p + "." for p in common)


def _check_arch_names(
    plan: Plan, node: str, tensors: Mapping[str, tuple[torch.Tensor, bool]], tp_rank: int, tp_size: int
) -> None:
    """Every arch tensor is a module tensor of this rank's shard shape (what the plan was sized from)."""
    info = plan.node(node)
    if info.arch is None:
        return
    for t in info.arch.tensors:
        if t.name not in tensors:
            raise WeightsError(
                f"node '{node}' ({info.impl}) has no tensor '{t.name}' that its arch "
                f"'{info.arch.name}' lists; its tensors: {_sample(tensors)}"
            )
        want = _sliced_shape(t.shape, _shard_slices(plan, node, t.name, t.shape, tp_rank, tp_size))
        got = tuple(tensors[t.name][0].shape)
        if got != want:
            raise WeightsError(
                f"node '{node}' ({info.impl}): tensor '{t.name}' has shape {list(got)}; "
                f"its arch '{info.arch.name}' gives {list(want)} (tp rank {tp_rank} of {tp_size})"
            )


def _sample(names: Iterable[str], n: int = 5) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "") or "(none)"


def _dummy_init(
    plan: Plan,
    node: str,
    tensors: Mapping[str, tuple[torch.Tensor, bool]],
    tp_rank: int = 0,
    tp_size: int = 1,
) -> None:
    info = plan.node(node)
    arch = {t.name: tuple(t.shape) for t in info.arch.tensors} if info.arch is not None else {}
    with torch.no_grad():
        for name, (t, is_param) in tensors.items():
            if not is_param or not t.is_floating_point():
                continue  # buffers are computed constants (RoPE tables, ...); keep them
            seed = int.from_bytes(hashlib.sha256(f"{node}/{name}".encode()).digest()[:8], "little") >> 1
            if t.dim() >= 2:
                # The full tensor's values, then this rank's slice of them: every tp rank cuts
                # the same tensor, so a sharded node computes what the whole one does.
                full = arch.get(name, tuple(t.shape))
                slices = _shard_slices(plan, node, name, full, tp_rank, tp_size)
                # matrices: N(0, 0.02) as transformers initialise them; conv kernels (3+ dims):
                # N(0, 1/sqrt(fan_in)), else a deep codec's output decays to silence (1e-9)
                std = 0.02 if t.dim() == 2 else math.prod(full[1:]) ** -0.5
                gen = torch.Generator(device=t.device).manual_seed(seed)
                values = torch.empty(full, dtype=torch.float32, device=t.device).normal_(
                    0.0, std, generator=gen
                )
                t.copy_(values[slices])
            elif t.dim() == 1 and "norm" in name.lower() and not name.endswith("bias"):
                t.fill_(1.0)
            else:
                t.zero_()


# ---------------------------------------------------------------------------- checkpoint
class Checkpoint:
    """The safetensors files of one weights folder: tensor -> file, headers, lazy reads."""

    def __init__(
        self,
        folder: Path,
        files_of: dict[str, str],
        headers: dict[str, dict[str, Any]],
        header_sha256: dict[str, str],
    ):
        self.folder = folder
        self.files_of = files_of  # tensor name -> file name
        self.headers = headers  # file name -> its header (tensor -> {dtype, shape, ...})
        self.header_sha256 = header_sha256
        self._open: dict[str, Any] = {}

    @property
    def file_names(self) -> list[str]:
        return sorted(self.headers)

    @classmethod
    def open(cls, folder: Path) -> Checkpoint:
        index = folder / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WeightsError(f"'{index}' is not a valid safetensors index: {e}") from None
            names = sorted(set(weight_map.values()))
        else:
            weight_map = None
            names = sorted(p.name for p in folder.glob("*.safetensors"))
        if not names:
            raise WeightsError(f"weights folder '{folder}' holds no .safetensors files")
        headers, hashes, files_of = {}, {}, {}
        for name in names:
            headers[name], hashes[name] = read_header(folder / name)
            for tensor in headers[name]:
                if tensor in files_of:
                    raise WeightsError(f"tensor '{tensor}' is in both '{files_of[tensor]}' and '{name}'")
                files_of[tensor] = name
        if weight_map is not None:
            for tensor, file in sorted(weight_map.items()):
                if files_of.get(tensor) != file:
                    raise WeightsError(
                        f"'{INDEX_FILE}' puts tensor '{tensor}' in '{file}', which does not hold it"
                    )
        return cls(folder, files_of, headers, hashes)

    def verify_against(self, plan: Plan, subdir: str = "") -> None:
        """The files the plan was compiled against must be unchanged (same header hash).

        Files of sub-folder checkpoints are listed as `<subdir>/<file>`; each folder checks its own."""
        if plan.weights.kind != "dir":
            return
        prefix = f"{subdir}/" if subdir else ""
        for f in plan.weights.files:
            if "/" in f.name and not f.name.startswith(prefix) or (not prefix and "/" in f.name):
                continue  # another folder's file
            have = self.header_sha256.get(f.name.removeprefix(prefix))
            if have is None:
                raise WeightsError(
                    f"checkpoint file '{f.name}' that the plan was compiled against is "
                    f"missing from '{self.folder}'"
                )
            if have != f.header_sha256:
                raise WeightsError(
                    f"checkpoint file '{f.name}' in '{self.folder}' differs from the one the plan "
                    "was compiled against (header hash); recompile the plan with these weights"
                )

    def shape(self, tensor: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self.headers[self.files_of[tensor]][tensor]["shape"])

    def read(self, tensor: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """The tensor (or this rank's slice of it) on the CPU; only that slice is read."""
        file = self.files_of[tensor]
        try:
            handle = self._open.get(file)
            if handle is None:
                handle = self._open[file] = safe_open(str(self.folder / file), framework="pt", device="cpu")
            if all(s == slice(None) for s in slices):
                return handle.get_tensor(tensor)
            return handle.get_slice(tensor)[slices]
        except SafetensorError as e:  # the header parsed, the rest did not: a cut-off copy, say
            raise WeightsError(f"checkpoint file '{self.folder / file}' is truncated or corrupt: {e} "
                               f"(reading tensor '{tensor}')") from None


def read_header(path: Path) -> tuple[dict[str, Any], str]:
    """(tensor -> {dtype, shape, data_offsets}, sha256 of the raw header) of one safetensors file."""
    try:
        return safetensors_header.read_header(path)
    except safetensors_header.HeaderError as e:
        raise WeightsError(str(e)) from None
