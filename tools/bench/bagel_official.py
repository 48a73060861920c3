"""The official BAGEL code (ByteDance-Seed/Bagel) run on M*'s weights: a parity reference and a baseline.

`.official/` (git-ignored, made by tools/official_bagel.sh) holds the official snapshot
(`.official/Bagel`) and the transformers 4.49.0 stack it pins (`.official/site`). Nothing
of it is imported at module level: `setup()` does it, once per process, and installs what the
official code needs to run here (docs/models/bagel.md, Facts):

- sys.path: `.official/site` and `.official/Bagel` first, so `transformers` and
  `huggingface_hub` are the pinned ones. A process that already imported them from elsewhere
  is refused (OfficialError): two versions of a package cannot share a process, so run the
  official side in its own process (the test does) or before anything imports transformers
  (the benchmark does; M*'s runtime never imports it). `tokenizers` may already be loaded
  (M*'s tokenizer node uses it): the official code never tokenizes (see TokenizerAdapter),
  and transformers' version check reads the pinned one's metadata.
- `flash_attn.flash_attn_varlen_func` (imported at module top by qwen2_navit / siglip_navit):
  the real one when it imports, else a stand-in that runs SDPA per sequence of cu_seqlens
  with flash-attn's bottom-right-aligned causal mask and GQA by repeating K/V heads.
- `cv2` and `torchvision` (imported by data/transforms.py, which needs PIL's bicubic resize,
  ToTensor and Normalize): stubs only where they do not import (this machine; the GPU
  machine has both).
- the hard-coded `torch.bfloat16` casts of qwen2_navit / siglip_navit: for a model in another
  dtype (f32: the CPU test, and `parity`'s f32 reference on a GPU) those modules and the
  inferencer see a `torch` whose `bfloat16` is the model dtype and whose `autocast` does nothing
  (f32 weights would otherwise meet bf16 activations on the CPU, and run bf16 GEMMs under the
  autocast on a GPU). A bf16 model runs as released: bf16 weights under the inferencer's own
  `torch.autocast("cuda", bfloat16)`. The setting is per process (module globals): the latest
  `official_model` sets it.
- accelerate's device hooks: the official app loads the model with
  `load_checkpoint_and_dispatch(..., force_hooks=True)` and keeps the FLUX AE on the CPU;
  the inferencer relies on those hooks to move its host tensors. Here forward pre-hooks move
  tensor inputs to the model device on the modules it feeds from the host (embed_tokens,
  the ViT, the position tables, time_embedder, vae2llm, the Qwen2 model), and the AE sits
  behind `PlacedAE`, which runs it on its own device (`vae_device`: the CPU as in the app,
  or the model device as eval/gen/gen_images_mp.py does) and leaves its output there.

Everything else is the official code, unmodified: `InterleaveInferencer.interleave_inference`
builds the gen / cfg_text / cfg_img contexts, `Bagel.generate_image` runs the schedule and
the CFG, `generate_text` decodes. The latent after the last step is taken by shadowing the
inferencer's `decode_image` on the instance; greedy tokens are what `gen_text` hands the
tokenizer's `decode`.

RNG, as the official code draws it (`torch.manual_seed(seed)` first, as app.py's set_seed
for seed > 0): T2I's x_1 noise is `torch.randn` on the CPU's global generator; edit's posterior
eps is `randn_like(mean)` on the AE's device, drawn before x_1. With the AE on the CPU (the
app) both come from one CPU stream, eps first: M*'s FluxVaeEncoder (eps from a CPU generator of
the seed) and FlowStep.noise (skipping those `drawn` values) follow that order on every device.
With the AE on a GPU, eps come from the CUDA generator and x_1 from an untouched CPU stream:
edit then differs from M* in its noise, T2I does not.

API: `official_model(state_dicts, config, device, dtype)` -> `Official` (bf16 on a GPU as
released, or f32 anywhere); `official_from_worker`, or `worker_weights` + `release_worker` when
the worker's KV pool leaves no room for a second copy of the weights (a whole-H200 plan);
`official_t2i_latents`, `official_edit_latents`, `official_understand_tokens`;
`official_inferencer_timings` (+ `time_t2i`, `time_edit`, `time_understand`).
CLI (`python tools/bench/bagel_official.py ...`): `check` (imports, one tiny run on random
weights); `run --weights W --config C --jobs J --inputs I --out O` (jobs on given weights, the
CPU test's official side in a process of its own); `parity [--variant real] [--device cuda]`
(M*'s walks, then the official code in the plan's dtype and in f32, on the same dummy weights
in one process: errors relative to the latents' displacement, tokens, as JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.machinery
import importlib.util
import json
import math
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
OFFICIAL = ROOT / ".official"
TRANSFORMERS_VERSION = "4.49.0"
ISOLATED = ("transformers", "huggingface_hub")  # pure Python: must come from .official/site
SCALE_FACTOR, SHIFT_FACTOR = 0.3611, 0.1159  # FLUX AE (official load_ae)
VAE_PREFIXES = ("encoder.", "decoder.")  # ae.safetensors names; everything else is ema.safetensors
SPECIAL_NAMES = {"bos_id": "<|im_start|>", "eos_id": "<|im_end|>", "vision_start_id": "<|vision_start|>",
                 "vision_end_id": "<|vision_end|>"}
# Defaults of the official app's tabs (docs/models/bagel.md, Facts), which M*'s walks take too.
T2I_DEFAULTS = {"cfg_text_scale": 4.0, "cfg_img_scale": 1.5, "cfg_interval": (0.4, 1.0),
                "cfg_renorm_type": "global", "cfg_renorm_min": 0.0, "timestep_shift": 3.0}
EDIT_DEFAULTS = {"cfg_text_scale": 4.0, "cfg_img_scale": 2.0, "cfg_interval": (0.0, 1.0),
                 "cfg_renorm_type": "text_channel", "cfg_renorm_min": 0.0, "timestep_shift": 3.0}


class OfficialError(RuntimeError):
    """The official code cannot run here: the message says what is missing and how to get it."""


def missing(folder: Path = OFFICIAL) -> str | None:
    """Why the official code cannot be set up from `folder`, or None when it can."""
    for part in ("Bagel/modeling/bagel/bagel.py", "Bagel/inferencer.py", "site/transformers/__init__.py"):
        if not (folder / part).is_file():
            return f"{folder} has no {part}: run tools/official_bagel.sh (it makes the git-ignored .official/)"
    return None


# ------------------------------------------------------------------------------ stand-ins
def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
                           max_seqlen_k: int | None = None, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False, **_: Any) -> torch.Tensor:
    """flash-attn's varlen attention by SDPA, one sequence at a time: q [Tq, H, D], k/v [Tk, Hkv, D]
    packed by cu_seqlens; causal is bottom-right aligned (query i of Lq sees keys j <= i + Lk - Lq),
    as flash-attn >= 2.1; H / Hkv query heads share a K/V head."""
    if dropout_p:
        raise OfficialError("the flash_attn stand-in runs inference only (dropout_p must be 0)")
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cq) - 1):
        qi = q[cq[i]:cq[i + 1]].transpose(0, 1)
        ki, vi = k[ck[i]:ck[i + 1]].transpose(0, 1), v[ck[i]:ck[i + 1]].transpose(0, 1)
        if groups > 1:
            ki, vi = ki.repeat_interleave(groups, 0), vi.repeat_interleave(groups, 0)
        lq, lk = qi.shape[1], ki.shape[1]
        mask, is_causal = None, False
        if causal and lq == lk:
            is_causal = True
        elif causal and lq > 1:  # one query is the last position: it sees every key
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=is_causal, scale=softmax_scale)
        out[cq[i]:cq[i + 1]] = o.transpose(0, 1)
    return out


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers' find_spec probes need one
    mod.__dict__.update(attrs)
    return mod


def _cv2_stub() -> types.ModuleType:
    def unavailable(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise OfficialError(f"cv2.{name}: OpenCV is not installed (a stub: data/transforms.py imports cv2 for "
                            "training augmentations only)")

    mod = _module("cv2")
    mod.__getattr__ = unavailable  # type: ignore[attr-defined]
    return mod


def _torchvision_stub() -> dict[str, types.ModuleType]:
    """What data/transforms.py's ImageTransform uses of torchvision, for PIL images: F.resize with
    PIL's own filter (torchvision's PIL path), ToTensor (uint8 HWC -> float CHW / 255), Normalize."""
    from PIL import Image

    class InterpolationMode:
        NEAREST, BILINEAR, BICUBIC = "nearest", "bilinear", "bicubic"

    pil_filters = {"nearest": Image.NEAREST, "bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}

    def resize(img: Any, size: Sequence[int], interpolation: str = "bilinear", antialias: bool = True) -> Any:
        if not isinstance(img, Image.Image):
            raise OfficialError("the torchvision stub resizes PIL images only")
        return img.resize((int(size[1]), int(size[0])), pil_filters[interpolation])

    class ToTensor:
        def __call__(self, pic: Any) -> torch.Tensor:
            import numpy as np

            arr = np.array(pic, dtype=np.uint8, copy=True)
            if arr.ndim == 2:
                arr = arr[:, :, None]
            return torch.from_numpy(arr).permute(2, 0, 1).contiguous().to(torch.get_default_dtype()).div(255)

    class Normalize:
        def __init__(self, mean: Sequence[float], std: Sequence[float], inplace: bool = False):
            self.mean, self.std, self.inplace = list(mean), list(std), inplace

        def __call__(self, t: torch.Tensor) -> torch.Tensor:
            t = t if self.inplace else t.clone()
            mean = torch.as_tensor(self.mean, dtype=t.dtype, device=t.device).view(-1, 1, 1)
            std = torch.as_tensor(self.std, dtype=t.dtype, device=t.device).view(-1, 1, 1)
            return t.sub_(mean).div_(std)

    functional = _module("torchvision.transforms.functional", resize=resize, InterpolationMode=InterpolationMode)
    tr = _module("torchvision.transforms", ToTensor=ToTensor, Normalize=Normalize,
                 InterpolationMode=InterpolationMode, functional=functional)
    tv = _module("torchvision", transforms=tr, __version__="stub")
    return {"torchvision": tv, "torchvision.transforms": tr, "torchvision.transforms.functional": functional}


class _TorchView(types.ModuleType):
    """`torch` as the official modules see it when the model is not bf16: `bfloat16` is the model
    dtype and `autocast` does nothing (the official autocast only makes bf16 GEMMs of mixed inputs)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__("torch")
        self._bf16_as = dtype

    def __getattr__(self, name: str) -> Any:
        if name == "bfloat16":
            return self._bf16_as
        if name == "autocast":
            return lambda *a, **k: contextlib.nullcontext()
        return getattr(torch, name)


# ------------------------------------------------------------------------------ set-up
@dataclass
class Modules:
    """The official modules and classes, once imported."""

    folder: Path
    bagel: Any  # modeling.bagel.bagel
    qwen2_navit: Any
    siglip_navit: Any
    qwen2: Any  # modeling.qwen2.modeling_qwen2
    autoencoder: Any
    inferencer: Any
    transforms: Any  # data.transforms
    attention: str  # "flash_attn <version>" or "sdpa stand-in"
    stubs: list[str] = field(default_factory=list)
    commit: str = ""


_MODULES: Modules | None = None


def _foreign(name: str, site: Path) -> str | None:
    mod = sys.modules.get(name)
    path = getattr(mod, "__file__", None) if mod is not None else None
    if mod is None or (path and Path(path).resolve().is_relative_to(site.resolve())):
        return None
    return f"{name} {getattr(mod, '__version__', '?')} from {path}"


def setup(folder: Path = OFFICIAL) -> Modules:
    """Put `.official/` on sys.path, install the stand-ins and import the official modules (once)."""
    global _MODULES
    if _MODULES is not None:
        if _MODULES.folder != folder:
            raise OfficialError(f"the official code is already set up from {_MODULES.folder}, not {folder}")
        return _MODULES
    reason = missing(folder)
    if reason:
        raise OfficialError(reason)
    site, src = folder / "site", folder / "Bagel"
    clash = [c for c in (_foreign(n, site) for n in ISOLATED) if c]
    if clash:
        raise OfficialError(f"{', '.join(clash)} is already imported; the official code needs transformers "
                            f"{TRANSFORMERS_VERSION} from {site}: set up the official harness in a process of "
                            "its own, or before anything imports transformers")
    for p in (str(src), str(site)):
        if p not in sys.path:
            sys.path.insert(0, p)
    stubs: list[str] = []
    if importlib.util.find_spec("flash_attn") is not None:
        import flash_attn  # the real one (a GPU machine with flash-attn installed)

        attention = f"flash_attn {getattr(flash_attn, '__version__', '?')}"
    else:
        sys.modules["flash_attn"] = _module("flash_attn", flash_attn_varlen_func=flash_attn_varlen_func)
        attention = "sdpa stand-in"
    if importlib.util.find_spec("cv2") is None:
        sys.modules["cv2"] = _cv2_stub()
        stubs.append("cv2")
    if importlib.util.find_spec("torchvision") is None:
        sys.modules.update(_torchvision_stub())
        stubs.append("torchvision")
    write_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # keep .official/ small
    try:
        import transformers

        if transformers.__version__ != TRANSFORMERS_VERSION:
            raise OfficialError(f"transformers {transformers.__version__} imported from {transformers.__file__}, "
                                f"the official code pins {TRANSFORMERS_VERSION}")
        mods = Modules(
            folder=folder,
            bagel=importlib.import_module("modeling.bagel.bagel"),
            qwen2_navit=importlib.import_module("modeling.bagel.qwen2_navit"),
            siglip_navit=importlib.import_module("modeling.bagel.siglip_navit"),
            qwen2=importlib.import_module("modeling.qwen2.modeling_qwen2"),
            autoencoder=importlib.import_module("modeling.autoencoder"),
            inferencer=importlib.import_module("inferencer"),
            transforms=importlib.import_module("data.transforms"),
            attention=attention, stubs=stubs,
            commit=(src / "COMMIT").read_text().strip() if (src / "COMMIT").is_file() else "",
        )
    finally:
        sys.dont_write_bytecode = write_bytecode
    for name, mod in (("modeling.bagel.bagel", mods.bagel), ("inferencer", mods.inferencer)):
        if not Path(mod.__file__).resolve().is_relative_to(src.resolve()):
            raise OfficialError(f"'{name}' was imported from {mod.__file__}, not from {src} (a name clash)")
    _MODULES = mods
    return mods


def _redirect_bf16(mods: Modules, dtype: torch.dtype) -> None:
    """For a model in `dtype` other than bf16 the official hard casts to bf16 become casts to `dtype`
    and the inferencer's autocast is off; for bf16 the modules see torch itself (the released code)."""
    for mod in (mods.qwen2_navit, mods.siglip_navit, mods.inferencer):
        mod.torch = torch if dtype == torch.bfloat16 else _TorchView(dtype)


# ------------------------------------------------------------------------------ the model
class PlacedAE(torch.nn.Module):
    """The official AutoEncoder on its own device: inputs go there, outputs stay there (the
    official app keeps the AE on the CPU and its accelerate hooks move what the LLM gets)."""

    def __init__(self, ae: torch.nn.Module, device: torch.device):
        super().__init__()
        self.ae, self.device = ae.to(device), device

    def to_device(self, device: torch.device | str) -> PlacedAE:
        self.device = torch.device(device)
        self.ae.to(self.device)
        return self

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.ae.encode(x.to(self.device, torch.float32))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.ae.decode(z.to(self.device, torch.float32))


class TokenizerAdapter:
    """What the official inferencer calls on its tokenizer, without tokenizing anything itself:
    `encode(text)` returns ids registered for that text (`key_for`) or M*'s encoder's ids
    (no specials: the official code adds <|im_start|> / <|im_end|>); `decode(ids)` records the
    ids (the official gen_text decodes its whole reply once) and returns text whose specials are
    spelled out, as the official split on '<|im_start|>' needs."""

    def __init__(self, special_ids: Mapping[str, int], encode: Callable[[str], list[int]] | None = None,
                 decode: Callable[[list[int]], str] | None = None):
        self.specials = {int(special_ids[k]): name for k, name in SPECIAL_NAMES.items()}
        self._encode, self._decode = encode, decode
        self.known: dict[str, list[int]] = {}
        self.decoded: list[list[int]] = []

    def key_for(self, ids: Iterable[int]) -> str:
        """A text standing for these token ids (no special tokens) in official inputs."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if i in self.specials]
        if bad:
            raise OfficialError(f"prompt ids hold special token(s) {bad}: pass the text's ids without "
                                "<|im_start|>/<|im_end|> (the official code adds them)")
        key = f"\x00ids:{len(self.known)}"
        self.known[key] = ids
        return key

    def encode(self, text: str) -> list[int]:
        if text in self.known:
            return list(self.known[text])
        if self._encode is None:
            raise OfficialError("TokenizerAdapter has no encoder: pass token ids (key_for) or an encode function")
        return [int(i) for i in self._encode(text)]

    def decode(self, ids: Any) -> str:
        ids = [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        self.decoded.append(ids)
        out, run = [], []
        for i in ids + [None]:
            if i is None or i in self.specials:
                if run:
                    out.append(self._decode(run) if self._decode else "".join(f"[{t}]" for t in run))
                    run = []
                if i is not None:
                    out.append(self.specials[i])
            else:
                run.append(i)
        return "".join(out)


@dataclass
class Official:
    """An official Bagel model with its AE and an InterleaveInferencer over them."""

    model: Any
    vae: PlacedAE
    inferencer: Any
    tokenizer: TokenizerAdapter
    new_token_ids: dict[str, int]
    device: torch.device
    dtype: torch.dtype
    config: dict[str, Any]
    modules: Modules
    hooks: list[Any] = field(default_factory=list)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _cfg(config: Mapping[str, Any], key: str) -> Any:
    if key not in config:
        raise OfficialError(f"config value '{key}' is missing (expected the bagel walk's variant config)")
    return config[key]


def _merge(state_dicts: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    parts = [state_dicts] if isinstance(state_dicts, Mapping) else list(state_dicts)
    merged: dict[str, torch.Tensor] = {}
    for sd in parts:
        for k, v in sd.items():
            if k in merged:
                raise OfficialError(f"tensor '{k}' is in two state dicts")
            merged[k] = v
    return merged


def _load_into(module: torch.nn.Module, weights: Mapping[str, torch.Tensor], what: str) -> None:
    """Copy `weights` into `module`'s state by name: every official tensor must be given, with its shape,
    and every given tensor must be used."""
    own = module.state_dict(keep_vars=True)
    lacking = sorted(set(own) - set(weights))
    extra = sorted(set(weights) - set(own))
    if lacking or extra:
        raise OfficialError(f"{what}: {len(lacking)} official tensor(s) not given ({', '.join(lacking[:5])}) and "
                            f"{len(extra)} given tensor(s) the official modules lack ({', '.join(extra[:5])})")
    with torch.no_grad():
        for name, t in own.items():
            w = weights[name]
            if tuple(w.shape) != tuple(t.shape):
                raise OfficialError(f"{what}: '{name}' is {tuple(w.shape)}, the official module has {tuple(t.shape)}")
            t.copy_(w)


def _move_inputs(device: torch.device) -> Callable[..., Any]:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}

    return hook


def _configs(mods: Modules, cfg: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    """The official Qwen2Config, SiglipVisionConfig, AutoEncoderParams and BagelConfig of a walk
    variant's config, set as app.py sets them."""
    hidden, heads = int(_cfg(cfg, "hidden")), int(_cfg(cfg, "heads"))
    if "head_dim" in cfg and int(cfg["head_dim"]) * heads != hidden:
        raise OfficialError(f"the official Qwen2 attention needs head_dim = hidden / heads, got {cfg['head_dim']}")
    llm_config = mods.qwen2_navit.Qwen2Config(
        vocab_size=int(_cfg(cfg, "vocab")), hidden_size=hidden, intermediate_size=int(_cfg(cfg, "intermediate")),
        num_hidden_layers=int(_cfg(cfg, "layers")), num_attention_heads=heads,
        num_key_value_heads=int(_cfg(cfg, "kv_heads")), rope_theta=float(_cfg(cfg, "rope_theta")),
        rms_norm_eps=float(_cfg(cfg, "rms_eps")), max_position_embeddings=32768, hidden_act="silu",
        # app.py's settings; the attention is flash_attn_varlen_func's whatever this says, and
        # "eager" keeps transformers from asking for an installed flash-attn
        qk_norm=True, tie_word_embeddings=False, layer_module="Qwen2MoTDecoderLayer", freeze_und=False,
        _attn_implementation="eager",
    )
    patch, side = int(_cfg(cfg, "vit_patch")), int(_cfg(cfg, "vit_max_patches_per_side"))
    vit_config = mods.siglip_navit.SiglipVisionConfig(
        hidden_size=int(_cfg(cfg, "vit_hidden")), intermediate_size=int(_cfg(cfg, "vit_intermediate")),
        num_hidden_layers=int(_cfg(cfg, "vit_layers")), num_attention_heads=int(_cfg(cfg, "vit_heads")),
        num_channels=3, image_size=patch * side, patch_size=patch, hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6, attention_dropout=0.0, rope=False, _attn_implementation="eager",
    )
    ch_mult = [int(m) for m in _cfg(cfg, "vae_ch_mult")]
    ae_params = mods.autoencoder.AutoEncoderParams(
        resolution=256, in_channels=3, downsample=2 ** (len(ch_mult) - 1), ch=int(_cfg(cfg, "vae_ch")), out_ch=3,
        ch_mult=ch_mult, num_res_blocks=int(_cfg(cfg, "vae_res_blocks")), z_channels=int(_cfg(cfg, "vae_z_channels")),
        scale_factor=SCALE_FACTOR, shift_factor=SHIFT_FACTOR,
    )
    bagel_config = mods.bagel.BagelConfig(
        visual_gen=True, visual_und=True, llm_config=llm_config, vit_config=vit_config, vae_config=ae_params,
        latent_patch_size=int(_cfg(cfg, "latent_patch_size")), max_latent_size=int(_cfg(cfg, "max_latent_size")),
        vit_max_num_patch_per_side=side, connector_act="gelu_pytorch_tanh", interpolate_pos=False,
    )
    return llm_config, vit_config, ae_params, bagel_config


def _meta_bagel(mods: Modules, llm_config: Any, vit_config: Any, bagel_config: Any) -> Any:
    """The official Bagel on the meta device (no storage), its patch embedding in Linear form as app.py."""
    with torch.device("meta"):
        lm = mods.qwen2_navit.Qwen2ForCausalLM(llm_config)
        vit = mods.siglip_navit.SiglipVisionModel(vit_config)
        model = mods.bagel.Bagel(lm, vit, bagel_config)
        model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config, meta=True)
    return model


def official_shapes(config: Mapping[str, Any], folder: Path = OFFICIAL) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor the official Bagel and AutoEncoder of `config` load."""
    mods = setup(folder)
    llm_config, vit_config, ae_params, bagel_config = _configs(mods, config)
    model = _meta_bagel(mods, llm_config, vit_config, bagel_config)
    with torch.device("meta"):
        ae = mods.autoencoder.AutoEncoder(ae_params)
    return {k: tuple(v.shape) for sd in (model.state_dict(), ae.state_dict()) for k, v in sd.items()}


def official_model(state_dicts: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]],
                   config: Mapping[str, Any], device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, *, tokenizer: TokenizerAdapter | None = None,
                   vae_device: torch.device | str | None = None, folder: Path = OFFICIAL) -> Official:
    """The official Bagel (Qwen2 MoT + SigLIP NaViT + glue) and FLUX AutoEncoder built from the bagel
    walk's variant config, holding `state_dicts` (checkpoint names: `ema.safetensors` for the
    model, `ae.safetensors`'s `encoder.*` / `decoder.*` for the AE), on `device` in `dtype` (the
    AE in f32, as the official load_ae; on `vae_device`, default the CPU as in the official app).
    Built on the meta device and given storage once, so a real-size model costs one copy."""
    mods = setup(folder)
    device = torch.device(device)
    if dtype == torch.bfloat16 and device.type != "cuda":
        raise OfficialError("a bf16 official model needs a CUDA device: the official code mixes f32 inputs with "
                            "bf16 weights under torch.autocast('cuda'); use float32 on the CPU")
    weights = _merge(state_dicts)
    cfg = dict(config)
    llm_config, vit_config, ae_params, bagel_config = _configs(mods, cfg)
    model = _meta_bagel(mods, llm_config, vit_config, bagel_config)
    model = model.to(dtype).to_empty(device=device)
    # The one buffer (not in the checkpoint): RoPE's inverse frequencies, in f32 as the official
    # app has them (accelerate casts checkpoint tensors to bf16, not buffers).
    model.language_model.model.rotary_emb = mods.qwen2.Qwen2RotaryEmbedding(config=llm_config, device=device)
    buffers = [n for n, _ in model.named_buffers()]
    if buffers != ["language_model.model.rotary_emb.inv_freq"]:
        raise OfficialError(f"unexpected buffers in the official Bagel: {buffers} (a different snapshot?)")
    _load_into(model, {k: v for k, v in weights.items() if not k.startswith(VAE_PREFIXES)}, "Bagel")
    model.eval().requires_grad_(False)
    ae = mods.autoencoder.AutoEncoder(ae_params)
    _load_into(ae, {k: v for k, v in weights.items() if k.startswith(VAE_PREFIXES)}, "AutoEncoder")
    vae = PlacedAE(ae.eval().requires_grad_(False), torch.device(vae_device or "cpu"))
    _redirect_bf16(mods, dtype)
    hooks = []
    if device.type != "cpu":
        for mod in (model.language_model.model.embed_tokens, model.language_model.model, model.vit_model,
                    model.vit_pos_embed, model.latent_pos_embed, model.time_embedder, model.vae2llm):
            hooks.append(mod.register_forward_pre_hook(_move_inputs(device), with_kwargs=True))
    ids = {k: int(_cfg(cfg, k)) for k in SPECIAL_NAMES}
    new_token_ids = {"bos_token_id": ids["bos_id"], "eos_token_id": ids["eos_id"],
                     "start_of_image": ids["vision_start_id"], "end_of_image": ids["vision_end_id"]}
    tokenizer = tokenizer or TokenizerAdapter(ids)
    t, patch = mods.transforms, int(vit_config.patch_size)
    vae_side = min(1024, 16 * int(bagel_config.max_latent_size))
    vit_side = min(980, patch * int(bagel_config.vit_max_num_patch_per_side))
    # The official transforms at the released size; smaller plans scale them as M*'s nodes do
    # (contract: vae max = min(1024, 16 * max_latent_size), min = min(512, max // 2); vit alike).
    inferencer = mods.inferencer.InterleaveInferencer(
        model=model, vae_model=vae, tokenizer=tokenizer,
        vae_transform=t.ImageTransform(vae_side, min(512, vae_side // 2), 16),
        vit_transform=t.ImageTransform(vit_side, min(224, vit_side // 2), patch),
        new_token_ids=new_token_ids,
    )
    return Official(model, vae, inferencer, tokenizer, new_token_ids, device, dtype, cfg, mods, hooks)


BAGEL_NODES = ("llm", "vit", "vae_enc", "vae_dec")  # the nodes holding checkpoint tensors


def worker_weights(worker: Any, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The weights of an M* Worker's BAGEL nodes by checkpoint name; copies on `device` (e.g. "cpu",
    so that the worker can be freed before the official model is built), else the nodes' own tensors."""
    from mstar_runtime.weights import checkpoint_name

    out: dict[str, torch.Tensor] = {}
    for name in BAGEL_NODES:
        node = worker.engines[name].node
        for k, v in node.state_dict().items():
            out[checkpoint_name(node, k)] = v.detach() if device is None else v.detach().to(device, copy=True)
    return out


def release_worker(worker: Any) -> None:
    """Free an M* Worker's GPU memory (its nodes and KV pools) even while references to it remain:
    its engines are dropped (the worker is unusable afterwards), then the heap Worker froze at load
    (`gc.freeze`, so its reference cycles were out of the collector's reach) is unfrozen and
    collected, and the allocator's cache emptied."""
    import gc

    for engine in worker.engines.values():
        node = getattr(engine, "node", None)
        if node is not None:  # probes set as instance attributes close over the node: a cycle
            for name in [k for k in vars(node) if k.startswith("phase_")]:
                delattr(node, name)
    for value in vars(worker).values():  # engines, and the cohort maps that hold engines too
        if isinstance(value, dict):
            value.clear()
    gc.unfreeze()
    gc.collect()
    if worker.device.type == "cuda":
        torch.cuda.empty_cache()


def official_from_worker(worker: Any, device: torch.device | str | None = None, *,
                         vae_device: torch.device | str | None = None, folder: Path = OFFICIAL) -> Official:
    """`official_model` on the weights of an M* Worker's BAGEL nodes (by checkpoint name, in the plan's
    dtype), beside the worker on the same GPU; its tokenizer node encodes prompts for it. The AE runs
    on `vae_device` (default: the model device, as eval/gen/gen_images_mp.py; the app keeps it on the
    CPU, which M*'s edit noise follows: pass "cpu" for parity). The official model is a second copy
    of the weights: when the worker's KV pool leaves no room for it (a plan for a whole H200 gives
    its KV pool 90% of what the weights leave), take `worker_weights(worker, "cpu")` and
    `tokenizer_from_node(...)`, `release_worker(worker)`, then call `official_model` (as `parity`
    does; OfficialError says so)."""
    weights = worker_weights(worker)
    dtype = next(worker.engines["llm"].node.parameters()).dtype
    device = torch.device(device or worker.device)
    if device.type == "cuda":
        need = sum(w.numel() for k, w in weights.items() if not k.startswith(VAE_PREFIXES)) * dtype.itemsize
        free = torch.cuda.mem_get_info(device)[0]
        if free < need + (4 << 30):  # + activations and the 3 contexts at 1024^2
            raise OfficialError(f"{free / 2**30:.1f} GiB free on {device}, the official model needs "
                                f"{need / 2**30:.1f} GiB + ~4 GiB: copy worker_weights(worker, 'cpu'), "
                                "release_worker(worker) (its KV pool), then build official_model from the copy")
    return official_model(weights, worker.plan.config, device, dtype, tokenizer=tokenizer_from_node(
        worker.engines["tok"].node, worker.plan.config), vae_device=vae_device or device, folder=folder)


def tokenizer_from_node(tok: Any, config: Mapping[str, Any]) -> TokenizerAdapter:
    """A TokenizerAdapter encoding and decoding with M*'s Tokenizer node (its ids, its vocab)."""
    return TokenizerAdapter({k: int(config[k]) for k in SPECIAL_NAMES},
                            encode=lambda text: tok.segment([text])[0][1:-1].tolist(), decode=tok.decode)


# ------------------------------------------------------------------------------ runs
def _pil(image: torch.Tensor) -> Any:
    from PIL import Image

    if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or image.dim() != 3 or image.shape[2] != 3:
        raise OfficialError("images are uint8 [H, W, 3] tensors (RGB)")
    return Image.fromarray(image.cpu().numpy())


def _text(off: Official, prompt: str | Sequence[int] | torch.Tensor) -> str:
    if isinstance(prompt, str):
        return prompt
    return off.tokenizer.key_for(prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)


def _hyper(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise OfficialError(f"unknown generation setting(s) {sorted(unknown)}; known: {sorted(defaults)}")
    h = {**defaults, **overrides}
    h["cfg_interval"] = [float(x) for x in h["cfg_interval"]]
    return h


def settings_from_walk(inputs: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The official generation settings of walk-style inputs (cfg_text_scale, cfg_img_scale,
    cfg_renorm_type, cfg_renorm_min, timestep_shift, cfg_interval_start / _end as one pair); other
    keys are ignored."""
    s = {k: inputs[k] for k in ("cfg_text_scale", "cfg_img_scale", "cfg_renorm_type", "cfg_renorm_min")
         if k in inputs}
    if "timestep_shift" in inputs:
        s["timestep_shift"] = inputs["timestep_shift"]
    if "cfg_interval_start" in inputs or "cfg_interval_end" in inputs:
        lo, hi = defaults["cfg_interval"]
        s["cfg_interval"] = [inputs.get("cfg_interval_start", lo), inputs.get("cfg_interval_end", hi)]
    return _hyper(defaults, s)


@contextlib.contextmanager
def _latent_capture(off: Official) -> Iterator[list[torch.Tensor]]:
    """The latent gen_image hands decode_image (after the last Euler step), instead of decoding it."""
    got: list[torch.Tensor] = []

    def capture(latent: torch.Tensor, image_shape: Any) -> None:
        got.append(latent.detach().float().cpu())

    off.inferencer.decode_image = capture  # an instance attribute shadows the method
    try:
        yield got
    finally:
        del off.inferencer.decode_image


def _generate(off: Official, inputs: list[Any], seed: int, num_timesteps: int, hyper: dict[str, Any],
              image_shapes: tuple[int, int] | None = None) -> torch.Tensor:
    extra = {"image_shapes": image_shapes} if image_shapes else {}
    with _latent_capture(off) as got, torch.no_grad():
        torch.manual_seed(seed)  # app.py's set_seed: the CPU generator and every CUDA one
        off.inferencer.interleave_inference(inputs, num_timesteps=num_timesteps, **hyper, **extra)
    if len(got) != 1:
        raise OfficialError(f"the official gen_image ran {len(got)} times, expected once")
    return got[0]


def official_t2i_latents(off: Official, prompt: str | Sequence[int] | torch.Tensor, *, height: int, width: int,
                         num_timesteps: int, seed: int, **settings: Any) -> torch.Tensor:
    """Official T2I (`interleave_inference([prompt])`): the latent f32 [h*w, patch_dim] after
    num_timesteps - 1 Euler steps, before the VAE decoder. `prompt`: text (the tokenizer's) or the
    ids of its tokens without specials. `settings` override T2I_DEFAULTS (cfg_text_scale,
    cfg_img_scale, cfg_interval, cfg_renorm_type, cfg_renorm_min, timestep_shift)."""
    return _generate(off, [_text(off, prompt)], seed, num_timesteps, _hyper(T2I_DEFAULTS, settings),
                     (int(height), int(width)))


def official_edit_latents(off: Official, image: torch.Tensor, prompt: str | Sequence[int] | torch.Tensor, *,
                          num_timesteps: int, seed: int, **settings: Any) -> torch.Tensor:
    """Official edit (`interleave_inference([image, prompt])`: VAE + ViT of the VAE-resized image in
    gen, cfg_text = the images, cfg_img = the prompt): the latent after num_timesteps - 1 steps, of
    the resized image's size. `settings` override EDIT_DEFAULTS."""
    return _generate(off, [_pil(image), _text(off, prompt)], seed, num_timesteps, _hyper(EDIT_DEFAULTS, settings))


def official_understand_tokens(off: Official, image: torch.Tensor | None, question: str | Sequence[int] | torch.Tensor,
                               *, max_length: int) -> torch.Tensor:
    """Official understanding (`interleave_inference([image, question], understanding_output=True)`,
    greedy; text chat without an image): the generated ids (int64), without the <|im_start|>
    generate_text starts from and without the <|im_end|> it stops on. generate_text returns at
    most max_length - 1 of them (its first slot holds the start token)."""
    inputs = ([_pil(image)] if image is not None else []) + [_text(off, question)]
    before = len(off.tokenizer.decoded)
    with torch.no_grad():
        off.inferencer.interleave_inference(inputs, understanding_output=True, max_think_token_n=int(max_length),
                                            do_sample=False)
    calls = off.tokenizer.decoded[before:]
    if len(calls) != 1:
        raise OfficialError(f"the official gen_text decoded {len(calls)} times, expected once")
    ids = calls[0]
    if not ids or ids[0] != off.new_token_ids["bos_token_id"]:
        raise OfficialError(f"generate_text's reply does not start with <|im_start|>: {ids[:4]}")
    return torch.tensor(ids[1:], dtype=torch.int64)


# ------------------------------------------------------------------------------ timings
def _timed(off: Official, fn: Callable[[], Any]) -> tuple[float, Any]:
    off.sync()
    t0 = time.perf_counter()
    out = fn()
    off.sync()
    return time.perf_counter() - t0, out


def time_t2i(off: Official, t2i: Mapping[str, Any]) -> float:
    """Seconds of one official T2I to a PIL image (`inferencer(text=...)`), walk-style inputs:
    prompt (text, or its ids without specials), height, width, num_timesteps, seed, and the walk's
    optional CFG inputs (settings_from_walk)."""
    h = settings_from_walk(t2i, T2I_DEFAULTS)
    torch.manual_seed(int(t2i.get("seed", 0)))
    sec, out = _timed(off, lambda: off.inferencer(text=_text(off, t2i["prompt"]), num_timesteps=int(t2i["num_timesteps"]),
                                                  image_shapes=(int(t2i["height"]), int(t2i["width"])), **h))
    if out.get("image") is None:
        raise OfficialError("the official T2I returned no image")
    return sec


def time_edit(off: Official, edit: Mapping[str, Any]) -> float:
    """Seconds of one official edit to a PIL image: source (uint8 [H, W, 3]), prompt,
    num_timesteps, seed, and the walk's optional CFG inputs."""
    h = settings_from_walk(edit, EDIT_DEFAULTS)
    torch.manual_seed(int(edit.get("seed", 0)))
    sec, out = _timed(off, lambda: off.inferencer(image=_pil(edit["source"]), text=_text(off, edit["prompt"]),
                                                  num_timesteps=int(edit["num_timesteps"]), **h))
    if out.get("image") is None:
        raise OfficialError("the official edit returned no image")
    return sec


def time_understand(off: Official, und: Mapping[str, Any]) -> tuple[int, float, float]:
    """One official understanding (greedy): (generated tokens, seconds, TTFT seconds). TTFT is the
    first lm_head output (the first generated token), synchronised: generate_text reads every
    token back anyway to test it against <|im_end|>."""
    first: list[float] = []

    def mark(module: Any, args: Any, output: Any) -> None:
        if not first:
            off.sync()
            first.append(time.perf_counter())

    handle = off.model.language_model.lm_head.register_forward_hook(mark)
    before = len(off.tokenizer.decoded)
    try:
        off.sync()
        t0 = time.perf_counter()
        off.inferencer(image=_pil(und["image"]), text=_text(off, und["question"]), understanding_output=True,
                       max_think_token_n=int(und.get("max_length", 500)), do_sample=False)
        off.sync()
        sec = time.perf_counter() - t0
    finally:
        handle.remove()
    ids = off.tokenizer.decoded[before][1:]
    return len(ids), sec, first[0] - t0


def official_inferencer_timings(off: Official, *, t2i: Mapping[str, Any] | None = None,
                                edit: Mapping[str, Any] | None = None, und: Mapping[str, Any] | None = None,
                                repeats: int = 1, und_batch: int = 16, warmup: bool = True) -> dict[str, Any]:
    """The official InterleaveInferencer timed at B = 1 (walk-style inputs, see time_*): T2I and
    edit seconds (median of `repeats`), understanding tokens/s and TTFT. The official inferencer
    has no batching: B > 1 is B requests one after another, so its B = `und_batch` figure is the
    B = 1 rate, and is reported as such."""
    rec: dict[str, Any] = {"attention": off.modules.attention, "stubs": off.modules.stubs,
                           "commit": off.modules.commit, "vae_device": str(off.vae.device),
                           "dtype": str(off.dtype).replace("torch.", ""), "batching": "none (B > 1 is sequential)"}
    if warmup:  # CUDA context, cuBLAS handles, the allocator: not the official code's cost
        side = 16 * min(4, int(off.config["max_latent_size"]))
        time_t2i(off, {"prompt": [1, 2, 3], "height": side, "width": side, "num_timesteps": 3, "seed": 0})
        if und is not None:
            time_understand(off, {**und, "max_length": 4})
    if t2i is not None:
        rec["t2i_b1_s"] = _median([time_t2i(off, t2i) for _ in range(repeats)])
    if edit is not None:
        rec["edit_b1_s"] = _median([time_edit(off, edit) for _ in range(repeats)])
    if und is not None:
        tokens, sec, ttft = time_understand(off, und)
        rate = tokens / sec
        rec["und_b1"] = {"tokens": tokens, "seconds": sec, "tokens_per_s": rate, "ttft_ms": 1e3 * ttft}
        rec[f"und_b{und_batch}_sequential"] = {"tokens_per_s": rate, "note": f"{und_batch} requests one after "
                                               "another: the official inferencer has no batching"}
    return rec


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


# ------------------------------------------------------------------------------ M* side
def compile_plan(variant: str, placement: Path, out: Path) -> Path:
    """models/bagel/bagel.walk compiled for `variant` and `placement` into `out`."""
    from mstarc.cli import main as mstarc

    rc = mstarc(["compile", str(ROOT / "models/bagel/bagel.walk"), "--variant", variant, "-p", str(placement),
                 "-o", str(out)])
    if rc != 0:
        raise OfficialError(f"mstarc compile of the bagel walk ({variant}, {placement.name}) failed: {rc}")
    return out


class MStarRun:
    """A compiled BAGEL plan on a Conductor with rank 0's Worker in this process, with probes on the
    nodes' phases (instance attributes: StatelessNode.run finds them first): the latent the VAE
    decoder receives (after the last Euler step), flow.noise's x_1 and the streamed tokens (the
    new token of each detokenize chunk)."""

    def __init__(self, plan_path: Path, device: str = "cpu", weights: str = "dummy"):
        from mstar_runtime.control.conductor import Conductor
        from mstar_runtime.plan.loader import load_plan
        from mstar_runtime.worker.worker import Worker

        self.plan = load_plan(plan_path, device=device)
        self.worker = Worker(self.plan, 0, device, weights)
        self.conductor = Conductor(self.plan, {0: self.worker})
        self.latents: list[torch.Tensor] = []
        self.noise: list[torch.Tensor] = []
        self.tokens: list[int] = []
        self._probe("vae_dec", "decode", lambda e, o: self.latents.append(e["latent"].detach().float().cpu()))
        self._probe("flow", "noise", lambda e, o: self.noise.append(o["latent"].detach().float().cpu()))
        self._probe("tok", "detokenize", lambda e, o: self.tokens.append(int(e["tokens"][-1])))

    def _probe(self, node_name: str, phase: str, record: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
        node = self.worker.engines[node_name].node
        method = getattr(node, f"phase_{phase}")

        def probed(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
            out = method(batch)
            for e, o in zip(batch, out, strict=True):
                record(e, o)
            return out

        setattr(node, f"phase_{phase}", probed)

    def run(self, walk: str, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """One request of `walk`, alone; its outputs (the probes hold its latents and tokens)."""
        from mstar_runtime.control.conductor import FINISHED

        self.latents.clear()
        self.noise.clear()
        self.tokens.clear()
        h = self.conductor.submit(walk, dict(inputs))
        self.conductor.run_until_idle()
        if h.state != FINISHED:
            raise OfficialError(f"M* {walk} failed: {h.error}")
        return h.outputs

    def segment_ids(self, text: str) -> list[int]:
        """The tokenizer node's ids of `text`, without the <|im_start|> / <|im_end|> it adds."""
        return self.worker.engines["tok"].node.segment([text])[0][1:-1].tolist()


def synthetic_image(h: int, w: int, seed: int = 0) -> torch.Tensor:
    """A smooth RGB image (uint8 [h, w, 3]): gradients and a disc, so that resizing has work to do."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    img = torch.stack([xx, yy, 1 - xx * yy], -1)
    cy, cx, r = torch.rand(3, generator=g)
    img[((yy - cy) ** 2 + (xx - cx) ** 2) < (0.15 + 0.2 * r) ** 2] = torch.rand(3, generator=g)
    return (img * 255).round().to(torch.uint8)


def latent_error(ours: torch.Tensor, official: torch.Tensor, x1: torch.Tensor) -> dict[str, float]:
    """max and RMS |ours - official| relative to the official displacement from the shared x_1."""
    moved = official - x1
    diff = ours - official
    return {"max_rel": diff.abs().max().item() / max(moved.abs().max().item(), 1e-30),
            "rms_rel": diff.norm().item() / max(moved.norm().item(), 1e-30), "moved_max": moved.abs().max().item()}


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _official_cases(off: Official, cases: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, c in cases.items():
        if "source" in c:
            out[name] = official_edit_latents(off, c["source"], c["prompt"], num_timesteps=c["num_timesteps"],
                                              seed=c["seed"], **settings_from_walk(c, EDIT_DEFAULTS))
        elif "question" in c:
            out[name] = official_understand_tokens(off, c["image"], c["question"], max_length=c["max_length"]).tolist()
        else:
            out[name] = official_t2i_latents(off, c["prompt"], height=c["height"], width=c["width"],
                                             num_timesteps=c["num_timesteps"], seed=c["seed"],
                                             **settings_from_walk(c, T2I_DEFAULTS))
    return out


def parity(variant: str, device: str, size: int, edit_size: int, num_timesteps: int, answer: int,
           folder: Path = OFFICIAL) -> dict[str, Any]:
    """M*'s t2i (with and without CFG), edit and understand walks against the official code on the
    same `dummy` weights, in one process: M* first (it never imports transformers), its weights
    copied to the host and the worker released (its KV pool fills the GPU); then the official model
    on `device` in the plan's dtype, and, when that is not f32, again in f32 (the same weights
    upcast, bf16 casts redirected, no autocast): a reference that says how far each bf16 run is
    from exact. The AE runs on the CPU (the app's placement, whose eps order M*'s edit follows)."""
    import gc
    import tempfile

    placement = ROOT / "placements" / ("h200x1.yaml" if device.startswith("cuda") else "cpu.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        ms = MStarRun(compile_plan(variant, placement, Path(tmp) / "bagel.plan"), device)
    rec: dict[str, Any] = {"variant": variant, "device": device, "size": size, "edit_size": edit_size,
                           "num_timesteps": num_timesteps, "answer": answer}
    t2i = {"prompt": "A photo of a red fox sitting in the snow at the edge of a pine forest", "height": size,
           "width": size, "num_timesteps": num_timesteps, "seed": 0}
    cases: dict[str, dict[str, Any]] = {
        "t2i": t2i,
        "t2i_nocfg": {**t2i, "cfg_text_scale": 1.0, "seed": 1},
        "edit": {"source": synthetic_image(edit_size, edit_size, 1), "prompt": "Make the sky purple and add a "
                 "full moon", "num_timesteps": num_timesteps, "seed": 0},
        "und": {"image": synthetic_image(edit_size, edit_size, 2), "question": "What is in this image? Describe it.",
                "max_length": answer},
    }
    ours: dict[str, Any] = {}
    t0 = time.perf_counter()
    for name, c in cases.items():
        ms.run("edit" if "source" in c else "understand" if "question" in c else "t2i", c)
        ours[name] = list(ms.tokens) if "question" in c else (ms.latents[-1], ms.noise[-1])
    rec["mstar_s"] = time.perf_counter() - t0
    weights = worker_weights(ms.worker, "cpu")
    config, tok = dict(ms.plan.config), tokenizer_from_node(ms.worker.engines["tok"].node, ms.plan.config)
    dtype = next(ms.worker.engines["llm"].node.parameters()).dtype
    release_worker(ms.worker)
    del ms
    if device.startswith("cuda"):
        rec["gpu_free_gib_after_release"] = torch.cuda.mem_get_info()[0] / 2**30
    runs: dict[str, dict[str, Any]] = {}
    for dt in dict.fromkeys([dtype, torch.float32]):
        t0 = time.perf_counter()
        off = official_model(weights, config, device, dt, tokenizer=tok, vae_device="cpu", folder=folder)
        key = str(dt).replace("torch.", "")
        rec[f"official_{key}_build_s"] = time.perf_counter() - t0
        rec["attention"], rec["stubs"], rec["commit"] = off.modules.attention, off.modules.stubs, off.modules.commit
        t0 = time.perf_counter()
        runs[key] = _official_cases(off, cases)
        rec[f"official_{key}_s"] = time.perf_counter() - t0
        del off
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    native, exact = runs[str(dtype).replace("torch.", "")], runs["float32"]
    for name, c in cases.items():
        if "question" in c:
            rec[name] = {"mstar": ours[name], "official": native[name], "official_f32": exact[name],
                         "common_prefix": common_prefix(ours[name], native[name]),
                         "common_prefix_f32": {"mstar": common_prefix(ours[name], exact[name]),
                                               "official": common_prefix(native[name], exact[name])}}
            continue
        lat, x1 = ours[name]
        rec[name] = {"mstar_vs_official": latent_error(lat, native[name], x1)}
        if native is not exact:
            rec[name]["mstar_vs_f32"] = latent_error(lat, exact[name], x1)
            rec[name]["official_vs_f32"] = latent_error(native[name], exact[name], x1)
    return rec


# ------------------------------------------------------------------------------ CLI
def _tiny_config() -> dict[str, Any]:
    """The bagel walk's `variant tiny` values the official modules read."""
    return {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 300,
            "rope_theta": 1e6, "rms_eps": 1e-6, "vit_layers": 2, "vit_hidden": 32, "vit_heads": 2,
            "vit_intermediate": 64, "vit_patch": 14, "vit_max_patches_per_side": 4, "vae_ch": 32,
            "vae_ch_mult": [1, 2, 4, 4], "vae_res_blocks": 2, "vae_z_channels": 4, "latent_patch_size": 2,
            "max_latent_size": 4, "bos_id": 296, "eos_id": 297, "vision_start_id": 298, "vision_end_id": 299}


def _random_weights(off_shapes: Mapping[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in off_shapes.items():
        if len(shape) >= 2:
            out[name] = torch.randn(shape, generator=g) / math.sqrt(math.prod(shape[1:]))
        elif name.endswith("bias"):
            out[name] = 0.1 * torch.randn(shape, generator=g)
        else:
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
    return out


def _check(folder: Path) -> int:
    mods = setup(folder)
    import transformers

    print(f"official BAGEL {mods.commit[:12] or '?'}: transformers {transformers.__version__}, "
          f"attention {mods.attention}, stubs {mods.stubs or 'none'}, torch {torch.__version__}, "
          f"python {sys.version.split()[0]}")
    cfg = _tiny_config()
    off = official_model(_random_weights(official_shapes(cfg, folder), 0), cfg, "cpu", torch.float32, folder=folder)
    lat = official_t2i_latents(off, [5, 6, 7], height=32, width=48, num_timesteps=3, seed=0)
    img = (torch.arange(40 * 56 * 3) % 251).to(torch.uint8).reshape(40, 56, 3)
    edit = official_edit_latents(off, img, [8, 9], num_timesteps=3, seed=0)
    toks = official_understand_tokens(off, img, [10, 11, 12], max_length=6)
    ok = bool(torch.isfinite(lat).all() and torch.isfinite(edit).all())
    print(f"tiny run: t2i latent {tuple(lat.shape)}, edit latent {tuple(edit.shape)}, understanding "
          f"{toks.tolist()}: {'ok' if ok else 'NOT FINITE'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, default=OFFICIAL)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="import the official code and run it once at tiny size (random weights)")
    run = sub.add_parser("run", help="run jobs on given weights (the test's official side, a process of its own)")
    run.add_argument("--weights", type=Path, required=True, help="safetensors, checkpoint names")
    run.add_argument("--config", type=Path, required=True, help="JSON: the walk variant's config")
    run.add_argument("--jobs", type=Path, required=True, help="JSON list of jobs (see run_jobs)")
    run.add_argument("--inputs", type=Path, help="safetensors of the jobs' images")
    run.add_argument("--out", type=Path, required=True, help="safetensors: one tensor per job name")
    run.add_argument("--device", default="cpu")
    par = sub.add_parser("parity", help="M*'s walks against the official code on the same dummy weights")
    par.add_argument("--variant", default="real", choices=["real", "tiny"])
    par.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    par.add_argument("--size", type=int, default=1024, help="t2i side, px")
    par.add_argument("--edit-size", type=int, default=512, help="edit / understanding image side, px")
    par.add_argument("--num-timesteps", type=int, default=4, help="schedule points: num_timesteps - 1 Euler steps")
    par.add_argument("--answer", type=int, default=16, help="understanding max_length")
    par.add_argument("--out", type=Path, help="JSON of the figures")
    args = ap.parse_args(argv)
    if args.cmd == "check":
        return _check(args.folder)
    if args.cmd == "parity":
        rec = parity(args.variant, args.device, args.size, args.edit_size, args.num_timesteps, args.answer,
                     args.folder)
        text = json.dumps(rec, indent=2)
        print(text)
        if args.out:
            args.out.write_text(text)
        return 0
    from safetensors.torch import load_file, save_file

    weights = load_file(str(args.weights))
    config = json.loads(args.config.read_text())
    jobs = json.loads(args.jobs.read_text())
    images = load_file(str(args.inputs)) if args.inputs else {}
    off = official_model(weights, config, args.device, torch.float32, folder=args.folder)
    save_file(run_jobs(off, jobs, images), str(args.out))
    return 0


def run_jobs(off: Official, jobs: list[Mapping[str, Any]], images: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each job {"name", "task": "t2i" | "edit" | "understand", "prompt_ids" / "question_ids",
    "image" (a key of `images`), num_timesteps, seed, height, width, max_length, + settings}
    -> {name: latent or token ids}."""
    out: dict[str, torch.Tensor] = {}
    for job in jobs:
        j = dict(job)
        name, task = j.pop("name"), j.pop("task")
        if task == "t2i":
            out[name] = official_t2i_latents(off, j.pop("prompt_ids"), **j)
        elif task == "edit":
            out[name] = official_edit_latents(off, images[j.pop("image")], j.pop("prompt_ids"), **j)
        elif task == "understand":
            img = j.pop("image", None)
            out[name] = official_understand_tokens(off, images[img] if img else None, j.pop("question_ids"), **j)
        else:
            raise OfficialError(f"job '{name}': unknown task '{task}'")
        out[name] = out[name].contiguous()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
