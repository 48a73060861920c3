"""Bounds of image-generation walk inputs, checked by the server before a request reaches
the engine, on every route alike (`app.check_inputs`).

The engine would report these late, or not by field: a latent-diffusion walk fails deep in
a node (or in the interpreter, naming an internal loop count) when asked for an image its
latent position table cannot hold, or for more flow steps than its loop's bound. Each rule
applies to a walk only when the walk has an input of that name and type, and reads the
walk's *effective* values (its defaults where the request gave none), so that a default
the plan cannot honour (BAGEL's 1024 x 1024 on the tiny variant) is a 400 that says what
to send, not an engine failure.

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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar_runtime.serve.common import bad_request

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


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


def check_bounds(config: Mapping[str, Any], program: Mapping[str, Any], inputs: Mapping[str, Any],
                 fields: Mapping[str, str]) -> None:
    """Raise the 400 for the first input of a walk outside its bounds (module docstring)."""
    declared = {p["name"]: p for p in program["inputs"]}

    def value(name: str, kind: str) -> tuple[Any, bool]:
        """(effective value, whether it is the walk's default), or (None, False)."""
        p = declared.get(name)
        if p is None or p["type"]["kind"] != kind:
            return None, False
        if name in inputs:
            return inputs[name], False
        return p["default"], True

    def param(name: str) -> str:
        return fields.get(name, name)

    def default_note(is_default: bool, what: str) -> str:
        return f" ({what} is the walk's default; send one this plan can run)" if is_default else ""

    grid = image_grid(config)
    (h, h_default), (w, w_default) = value("height", "int"), value("width", "int")
    if grid is not None and _int(h) and _int(w):
        for name, side, is_default in (("width", w, w_default), ("height", h, h_default)):
            if not grid.fits(side):
                p = param(name)
                shown = f"{w}x{h}" if p == param("width") == param("height") else f"{name} {side}"
                raise bad_request(f"{p}: {shown} is not a size this plan generates: {grid.rule()}"
                                  f"{default_note(is_default, shown)}", p, "unsupported_size")

    n, n_default = value("num_timesteps", "int")
    most = max_timesteps(config)
    if _int(n) and most is not None and not 2 <= n <= most:
        raise bad_request(f"{param('num_timesteps')} must be from 2 to {most} (this plan's denoise loop runs at most "
                          f"{most - 1} steps, one fewer than the timesteps), got {n}"
                          f"{default_note(n_default, str(n))}", param("num_timesteps"), "out_of_range")

    for name, (lo, lo_ok, hi) in FLOAT_BOUNDS.items():
        v, is_default = value(name, "float")
        if isinstance(v, int | float) and not isinstance(v, bool) and not ((lo <= v if lo_ok else lo < v) and v <= hi):
            low = f"{lo:g} <= " if lo_ok else f"{lo:g} < "
            raise bad_request(f"{param(name)} must be {low}{name} <= {hi:g}, got {v:g}"
                              f"{default_note(is_default, f'{v:g}')}", param(name), "out_of_range")
    start, start_default = value("cfg_interval_start", "float")
    end, _ = value("cfg_interval_end", "float")
    if isinstance(start, int | float) and isinstance(end, int | float) and start > end:
        p = param("cfg_interval_end" if start_default else "cfg_interval_start")  # the one the client sent
        raise bad_request(f"{p}: the CFG interval must have start <= end, got [{start:g}, {end:g}]", p, "out_of_range")

    kind, kind_default = value("cfg_renorm_type", "str")
    if isinstance(kind, str) and kind not in RENORM_TYPES:
        raise bad_request(f"{param('cfg_renorm_type')} must be one of {', '.join(RENORM_TYPES)}, got {kind!r}"
                          f"{default_note(kind_default, repr(kind))}", param("cfg_renorm_type"))


__all__ = ["FLOAT_BOUNDS", "RENORM_TYPES", "ImageGrid", "check_bounds", "image_grid", "max_timesteps"]
