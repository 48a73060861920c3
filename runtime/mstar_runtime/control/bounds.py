"""Bounds of image-generation, world-model and speech walk inputs, checked before a request
is queued: by `conductor.check_inputs` for the CLI and the Python API (a `RequestError`), and
by the server on every route alike (`app.check_inputs`, a 400 naming the request's field).

The engine would report these late, or not by field: a latent-diffusion walk fails deep in
a node (or in the interpreter, naming an internal loop count) when asked for an image its
latent position table cannot hold, or for more flow steps than its loop's bound. Each rule
applies to a walk only when the walk has an input of that name and type, and reads the
walk's *effective* values (its defaults where the request gave none), so that a default
the plan cannot honour is reported as such, with what to send. Every input out of bounds
is reported at once (`out_of_bounds` lists them; one error says them all), not the first.

- `height` and `width` (ints), when the plan's config has the latent geometry
  (`max_latent_size`, `latent_patch_size`, `vae_ch_mult`): each side a multiple of the
  pixels per latent token (the VAE's downsampling, 2 ** (levels - 1), times the latent
  patch size: 16 for BAGEL) from one token to `max_latent_size` tokens (BAGEL: 1024 px;
  tiny: 64). Code `unsupported_size`.
- `num_timesteps` (the points of the flow schedule; its Euler steps are one fewer): from 2
  to the config's `max_timesteps` + 1 (the bound of the denoise loop).
- `cfg_text_scale`, `cfg_img_scale`: 0 to 100 (a scale <= 1 turns its branch off);
  `cfg_interval_start` <= `cfg_interval_end`, both in [0, 1]; `cfg_renorm_min` in [0, 1]
  (the lower clamp of a norm ratio whose upper clamp is 1); `cfg_renorm_type` one of
  `global`, `channel`, `text_channel`; `timestep_shift` in (0, 100].

Work sizes of world-model walks (V-JEPA 2), each when the plan's config has its bound, so
that no request asks a node for more rows or frames than the plan was built for (a CEM
`samples` of 10^9 once allocated past 24 GB inside one node call, which a disconnect cannot
interrupt):
- `samples` (int, the CEM's trajectories per iteration: rows of one predictor step): from 2
  to the config's `max_samples`; `topk` (int) from 1 to the effective `samples`;
- `actions` (a tensor [B, A, dim], B trajectories of a rollout): B at most `max_samples`;
- `frames` (a tensor [N, H, W, 3] to encode): N at most the config's `max_frames`.

Frames of speech (Qwen3-Omni): `talker_max_frames` (int) from 1 to the config's
`max_talker_frames`, the bound of the walk's frame loop (a larger value was cut there
silently).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mstar_runtime.ops.node import RequestError

RENORM_TYPES = ("global", "channel", "text_channel")
MAX_SCALE = 100.0
# name -> (lowest, whether the lowest is allowed, highest)
FLOAT_BOUNDS: dict[str, tuple[float, bool, float]] = {
    "cfg_text_scale": (0.0, True, MAX_SCALE),
    "cfg_img_scale": (0.0, True, MAX_SCALE),
    "cfg_interval_start": (0.0, True, 1.0),
    "cfg_interval_end": (0.0, True, 1.0),
    "cfg_renorm_min": (0.0, True, 1.0),
    "timestep_shift": (0.0, False, 100.0),
}


@dataclass(frozen=True)
class ImageGrid:
    """The image sizes a latent-diffusion plan generates: sides in multiples of `multiple`
    pixels (one latent token), up to `max_side` (its latent position table)."""

    multiple: int
    max_side: int
    max_latent: int

    def fits(self, side: int) -> bool:
        return self.multiple <= side <= self.max_side and side % self.multiple == 0

    def rule(self) -> str:
        return (f"each side must be a multiple of {self.multiple} from {self.multiple} to {self.max_side} px "
                f"(this plan's max_latent_size is {self.max_latent} latent tokens of {self.multiple} px)")


@dataclass(frozen=True)
class OutOfBounds:
    """One input (or two: a size's sides) out of bounds. `says` follows the inputs' names in
    the message (`render`), so that each caller names them its own way (the server by the
    request's fields); `code` is the server's error code."""

    names: tuple[str, ...]
    says: str
    code: str = "out_of_range"

    def render(self, field: Callable[[str], str] = str) -> str:
        named = list(dict.fromkeys(field(n) for n in self.names))  # width and height may share a field (size)
        return " and ".join(named) + self.says


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def image_grid(config: Mapping[str, Any]) -> ImageGrid | None:
    """The plan's `ImageGrid`, or None when its config has no latent geometry."""
    size, patch, mult = config.get("max_latent_size"), config.get("latent_patch_size"), config.get("vae_ch_mult")
    if not (_int(size) and _int(patch) and isinstance(mult, list) and mult and size > 0 and patch > 0):
        return None
    multiple = patch * 2 ** (len(mult) - 1)  # a VAE of n levels downsamples n - 1 times
    return ImageGrid(multiple, multiple * size, size)


def max_timesteps(config: Mapping[str, Any]) -> int | None:
    bound = config.get("max_timesteps")
    return bound + 1 if _int(bound) and bound >= 1 else None


def _leading(value: Any) -> int | None:
    """The length of a tensor's first dimension, given as a tensor or as nested lists (the
    server checks its JSON before it becomes a tensor), or None for anything else."""
    if isinstance(value, list):
        return len(value)
    shape = getattr(value, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) >= 1 else None


def _work_sizes(config: Mapping[str, Any], value: Callable[[str, str], tuple[Any, bool]],
                note: Callable[[bool, str], str]) -> list[OutOfBounds]:
    """The world-model and speech work sizes out of bounds (module docstring)."""
    found: list[OutOfBounds] = []
    most = config.get("max_samples")
    samples, samples_default = value("samples", "int")
    if _int(most) and _int(samples) and not 2 <= samples <= most:
        found.append(OutOfBounds(("samples",), f" must be from 2 to {most} (this plan's max_samples: trajectories "
                                 f"per CEM iteration), got {samples}{note(samples_default, str(samples))}"))
    topk, topk_default = value("topk", "int")
    if _int(topk) and _int(samples) and not 1 <= topk <= max(samples, 1):
        found.append(OutOfBounds(("topk",), f" must be from 1 to samples ({samples}), got {topk}"
                                 f"{note(topk_default, str(topk))}"))
    rows = _leading(value("actions", "tensor")[0])
    if _int(most) and rows is not None and rows > most:
        found.append(OutOfBounds(("actions",), f" holds {rows} trajectories; this plan rolls out at most {most} "
                                 "per request (its max_samples)"))
    frames = _leading(value("frames", "tensor")[0])
    most_frames = config.get("max_frames")
    if _int(most_frames) and frames is not None and frames > most_frames:
        found.append(OutOfBounds(("frames",), f" holds {frames} frames; this plan encodes at most {most_frames} per "
                                 "request (its max_frames)"))
    talker, talker_default = value("talker_max_frames", "int")
    most_talker = config.get("max_talker_frames")
    if _int(most_talker) and _int(talker) and not 1 <= talker <= most_talker:
        found.append(OutOfBounds(("talker_max_frames",), f" must be from 1 to {most_talker} (this plan's "
                                 f"max_talker_frames, the bound of its frame loop), got {talker}"
                                 f"{note(talker_default, str(talker))}"))
    return found


def out_of_bounds(config: Mapping[str, Any], program: Mapping[str, Any],
                  inputs: Mapping[str, Any]) -> list[OutOfBounds]:
    """Every input of a walk outside its bounds (module docstring), in the walk's terms.
    `inputs` are those the request gave; the others are the walk's defaults."""
    declared = {p["name"]: p for p in program["inputs"]}
    found: list[OutOfBounds] = []

    def value(name: str, kind: str) -> tuple[Any, bool]:
        """(effective value, whether it is the walk's default), or (None, False)."""
        p = declared.get(name)
        if p is None or p["type"]["kind"] != kind:
            return None, False
        if name in inputs:
            return inputs[name], False
        return p["default"], True

    def default_note(is_default: bool, what: str) -> str:
        return f" ({what} is the walk's default; send one this plan can run)" if is_default else ""

    grid = image_grid(config)
    (h, h_default), (w, w_default) = value("height", "int"), value("width", "int")
    if grid is not None and _int(h) and _int(w):
        bad = [name for name, side in (("width", w), ("height", h)) if not grid.fits(side)]
        if bad:
            shown = f"{w}x{h} (width x height)"
            found.append(OutOfBounds(tuple(bad), f": {shown} is not a size this plan generates: {grid.rule()}"
                                     f"{default_note(w_default and h_default, shown)}", "unsupported_size"))

    n, n_default = value("num_timesteps", "int")
    most = max_timesteps(config)
    if _int(n) and most is not None and not 2 <= n <= most:
        found.append(OutOfBounds(("num_timesteps",), f" must be from 2 to {most} (this plan's denoise loop runs at "
                                 f"most {most - 1} steps, one fewer than the timesteps), got {n}"
                                 f"{default_note(n_default, str(n))}"))

    for name, (lo, lo_ok, hi) in FLOAT_BOUNDS.items():
        v, is_default = value(name, "float")
        if _number(v) and not ((lo <= v if lo_ok else lo < v) and v <= hi):
            low = f"{lo:g} <= " if lo_ok else f"{lo:g} < "
            found.append(OutOfBounds((name,), f" must be {low}{name} <= {hi:g}, got {v:g}"
                                     f"{default_note(is_default, f'{v:g}')}"))
    start, start_default = value("cfg_interval_start", "float")
    end, _ = value("cfg_interval_end", "float")
    if _number(start) and _number(end) and start > end:
        name = "cfg_interval_end" if start_default else "cfg_interval_start"  # the one the client sent
        found.append(OutOfBounds((name,), f": the CFG interval must have start <= end, got [{start:g}, {end:g}]"))

    kind, kind_default = value("cfg_renorm_type", "str")
    if isinstance(kind, str) and kind not in RENORM_TYPES:
        found.append(OutOfBounds(("cfg_renorm_type",), f" must be one of {', '.join(RENORM_TYPES)}, got {kind!r}"
                                 f"{default_note(kind_default, repr(kind))}", "invalid_value"))
    found.extend(_work_sizes(config, value, default_note))
    return found


def check_bounds(walk: str, config: Mapping[str, Any], program: Mapping[str, Any], inputs: Mapping[str, Any]) -> None:
    """Raise one `RequestError` that says every input out of bounds (naming the first)."""
    found = out_of_bounds(config, program, inputs)
    if found:
        raise RequestError(f"walk '{walk}': " + "; ".join(p.render() for p in found), found[0].names[0])


__all__ = ["FLOAT_BOUNDS", "RENORM_TYPES", "ImageGrid", "OutOfBounds", "check_bounds", "image_grid", "max_timesteps",
           "out_of_bounds"]
