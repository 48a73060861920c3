"""`POST /v1/images/generations` and `POST /v1/images/edits`, each installed only for the walk
that declares it (`serves image_generations`, `serves image_edits(image = source, output =
image)`: BAGEL's `t2i` and `edit`; docs/walk-language.md, "Routes"): `prompt` goes to the
`prompt` slot, an edit's image to the `image` slot, and the PNGs are the `image` (`output`) slot.

Responses are OpenAI's `{"created", "data": [{"b64_json": PNG}], "output_format": "png",
"size": "WxH"}`. `response_format: "url"` is a 400 naming `response_format`: there is no
file host, and answering inline instead would leave a client that reads `data[0].url`
with None. `n` images are `n` requests run concurrently; when the walk takes a `seed`,
image `i` gets `seed + i` (so they differ).

Size. `size` ("WxH") goes to the walk's `width` / `height` inputs. A plan with latent
geometry in its config (BAGEL) takes only sides it can hold: multiples of the pixels per
latent token up to `max_latent_size` tokens (`bounds.ImageGrid`: 16 to 1024 px for BAGEL,
to 64 px for its tiny variant); any other size is a 400 `unsupported_size` naming `size`
and the limit. No `size`, or `auto`: the walk's default when the plan holds it, else the
largest square it holds. A walk without `width` / `height` (BAGEL's `edit`, which keeps
the input image's size after its own resize) takes no other size than `auto`: a 400, not
a silently different image.

Walk inputs. Extra body keys that are inputs of the walk pass through (`extra_body`:
`seed`, `num_timesteps`, `cfg_text_scale`, ...), typed and bounded as on every route
(`app.walk_extras`, `app.check_inputs`, `control.bounds`). `cfg_interval: [start,
end]` (the official BAGEL argument) is the walk's `cfg_interval_start` / `cfg_interval_end`.

Edits take a multipart form as the openai client sends it: one `image` file (or `image[]`;
more than one is a 400 `too_many_images`), `prompt`, `model`, and a `mask` only when the
walk has a `mask` input. Other form fields are walk inputs, parsed from their text by the
input's declared type (`"4"` for an int, `"true"` for a bool, repeated `key[]` fields for
a list) and then checked as a JSON body's would be.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import torch

from mstar_runtime.api import RequestFailed
from mstar_runtime.control.bounds import image_grid
from mstar_runtime.serve.app import ERROR_RESPONSES, check_model, error_response, start_flight, walk_extras
from mstar_runtime.serve.common import ApiError, ClientGone, bad_request
from mstar_runtime.serve.flight import Flight
from mstar_runtime.serve.io import b64, decode_image, form_value, png_bytes
from mstar_runtime.serve.schemas import (
    INT64_MAX,
    INT64_MIN,
    MAX_PROMPT_CHARS,
    SIZE_PATTERN,
    ImageGenerationRequest,
)
from mstar_runtime.serve.web import File, Form, Request, UploadFile

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mstar_runtime.serve.state import ServerState, WalkRole

NO_URL = ("response_format 'url' is not served: this server has no file host; use 'b64_json' (the PNG "
          "inline)")
# form fields of an edit the route reads itself (the rest are walk inputs)
EDIT_FIELDS = {"image", "image[]", "prompt", "model", "mask", "n", "size", "response_format", "seed",
               "output_format", "quality", "user"}


def install(app: FastAPI, state: ServerState) -> None:
    if state.walks.t2i is not None:
        _install_generations(app, state, state.walks.t2i)
    if state.walks.edit is not None:
        _install_edits(app, state, state.walks.edit)


# ----------------------------------------------------------------------------- inputs
def size_inputs(state: ServerState, role: WalkRole, size: str | None) -> dict[str, int]:
    """`width` / `height` inputs for `size` (module docstring: the size rule)."""
    sized = "width" in role.inputs and "height" in role.inputs
    if not sized:
        if size and size != "auto":
            raise bad_request(f"size: walk '{role.walk}' chooses its image's size itself (an edit keeps its input "
                              "image's size); send no size, or 'auto'", "size", "unsupported_size")
        return {}
    if size and size != "auto":
        w, h = (int(x) for x in size.split("x"))
        return {"width": w, "height": h}
    grid = image_grid(state.plan.config)
    out: dict[str, int] = {}
    for name in ("width", "height"):
        default = role.inputs[name]["default"]
        if grid is not None and isinstance(default, int) and not grid.fits(default):
            default = grid.max_side  # `auto` on a plan smaller than the walk's default: the largest it holds
        if isinstance(default, int):
            out[name] = default
    return out


def interval_alias(role: WalkRole, extra: dict[str, Any]) -> dict[str, Any]:
    """`cfg_interval: [start, end]` as the walk's two interval inputs (checked by `control.bounds`)."""
    if "cfg_interval" not in extra:
        return extra
    out = dict(extra)
    value = out.pop("cfg_interval")
    if "cfg_interval_start" not in role.inputs or "cfg_interval_end" not in role.inputs:
        raise bad_request(f"unknown field 'cfg_interval' (walk '{role.walk}' has no CFG interval)", "cfg_interval",
                          "unknown_field")
    if "cfg_interval_start" in out or "cfg_interval_end" in out:
        raise bad_request("give cfg_interval or cfg_interval_start / cfg_interval_end, not both", "cfg_interval")
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
        raise bad_request("cfg_interval must be [start, end], two finite numbers in [0, 1]", "cfg_interval")
    out["cfg_interval_start"], out["cfg_interval_end"] = float(value[0]), float(value[1])
    return out


def extra_fields(extra: Mapping[str, Any], sent: Mapping[str, Any]) -> dict[str, str]:
    """The request field of each extra walk input: its own name, or `cfg_interval` for the
    two inputs that alias set."""
    alias = "cfg_interval" in sent
    return {k: "cfg_interval" if alias and k in ("cfg_interval_start", "cfg_interval_end") else k for k in extra}


def image_requests(state: ServerState, role: WalkRole, prompt: str, size: str | None, n: int,
                   extra: Mapping[str, Any], extra_fields: Mapping[str, str],
                   seed: int | None) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """Walk inputs and their request fields for each of the `n` images."""
    sized = size_inputs(state, role, size)
    fields = {**extra_fields, role.text_input: "prompt", **{k: "size" for k in ("width", "height")
                                                               if k in role.inputs}}
    per = []
    for i in range(n):
        inputs: dict[str, Any] = {**extra, role.text_input: prompt, **sized}
        if "seed" in role.inputs:
            base = seed if seed is not None else role.inputs["seed"]["default"] or 0
            inputs["seed"], fields["seed"] = base + i, "seed"
        per.append((inputs, dict(fields)))
    return per


# ----------------------------------------------------------------------------- running
async def run_images(state: ServerState, request: Request, role: WalkRole,
                     per_image: list[tuple[dict[str, Any], dict[str, str]]]) -> Any:
    flights: list[Flight] = []
    try:
        for inputs, fields in per_image:
            flights.append(await start_flight(state, request, "images", role.walk, inputs, fields, "prompt"))
    except BaseException:  # image k was refused: the k - 1 already submitted must not run on unseen
        for f in flights:
            f.handle.cancel()
        raise

    async def one(flight: Flight) -> tuple[bytes, str]:
        async with flight:
            outputs = await flight.outputs()
            flight.outcome = "finished"
        image = outputs.get(role.output)
        if not isinstance(image, torch.Tensor):
            raise ApiError(500, f"walk '{role.walk}' finished without its '{role.output}' output",
                           type="server_error", code="no_output")
        try:
            png = png_bytes(image)
        except ValueError as e:
            raise ApiError(500, f"walk '{role.walk}': {e}", type="server_error", code="bad_output") from None
        return png, _png_size(png)

    results = await asyncio.gather(*(one(f) for f in flights), return_exceptions=True)
    for f, r in zip(flights, results):
        if isinstance(r, (RequestFailed, ClientGone)):
            return error_response(f.answer_for(r))
        if isinstance(r, BaseException):
            raise r
    pngs = [r for r in results if isinstance(r, tuple)]
    return {"created": int(time.time()), "data": [{"b64_json": b64(png)} for png, _ in pngs],
            "output_format": "png", "size": pngs[0][1] if pngs else None}


def _png_size(png: bytes) -> str:
    """"WxH" from a PNG's IHDR chunk (bytes 16-24, big-endian)."""
    return f"{int.from_bytes(png[16:20], 'big')}x{int.from_bytes(png[20:24], 'big')}"


# ----------------------------------------------------------------------------- routes
def _install_generations(app: FastAPI, state: ServerState, role: WalkRole) -> None:

    @app.post("/v1/images/generations", tags=["openai"], responses=ERROR_RESPONSES,
              summary=f"Text to image (walk '{role.walk}'): b64_json PNGs")
    async def generations(body: ImageGenerationRequest, request: Request) -> Any:
        check_model(state, body.model)
        if body.response_format == "url":
            raise bad_request(NO_URL, "response_format", "unsupported")
        raw = dict(body.model_extra or {})
        extra = await walk_extras(state, role.walk, interval_alias(role, raw), {role.text_input, "width", "height"})
        fields = extra_fields(extra, raw)
        seed = extra.pop("seed", None)
        per = image_requests(state, role, body.prompt, body.size, body.n, extra, fields, seed)
        return await run_images(state, request, role, per)


def _install_edits(app: FastAPI, state: ServerState, role: WalkRole) -> None:
    image_input = role.slots["image"]
    kinds = {n: p["type"] for n, p in role.inputs.items()}

    @app.post("/v1/images/edits", tags=["openai"], responses=ERROR_RESPONSES,
              summary=f"Image edit (walk '{role.walk}'): multipart form in, b64_json PNGs out")
    async def edits(request: Request,
                    prompt: Annotated[str, Form(min_length=1, max_length=MAX_PROMPT_CHARS)],
                    model: Annotated[str, Form()],
                    image: Annotated[UploadFile | None, File(description="the image to edit (one)")] = None,
                    images: Annotated[list[UploadFile] | None, File(alias="image[]",
                                                                    description="or: one image as image[]")] = None,
                    mask: Annotated[UploadFile | None, File()] = None,
                    n: Annotated[int, Form(ge=1, le=10)] = 1,
                    size: Annotated[str | None, Form(pattern=SIZE_PATTERN)] = None,
                    response_format: Annotated[str | None, Form(pattern="^(b64_json|url)$")] = None,
                    output_format: Annotated[str | None, Form(pattern="^png$")] = None,
                    seed: Annotated[int | None, Form(ge=INT64_MIN, le=INT64_MAX)] = None) -> Any:
        check_model(state, model)
        if response_format == "url":
            raise bad_request(NO_URL, "response_format", "unsupported")
        form = await request.form()  # parsed already by FastAPI (cached): the fields it did not declare
        uploads = [u for u in [*form.getlist("image"), *form.getlist("image[]")] if not isinstance(u, str)]
        if not uploads:
            raise bad_request("'image' is required (the image to edit, as a file)", "image", "missing")
        if len(uploads) > 1:
            raise bad_request(f"walk '{role.walk}' edits one image; got {len(uploads)}", "image", "too_many_images")
        picture = await _read_image(uploads[0], "image")
        raw: dict[str, Any] = {}
        for key in {k for k in form.keys() if k not in EDIT_FIELDS}:
            name = key.removesuffix("[]")
            values = form.getlist(key)
            if any(not isinstance(v, str) for v in values):
                raise bad_request(f"{name}: a file was sent where a value was expected", name)
            declared = kinds.get(name)
            if key.endswith("[]") or len(values) > 1:
                raw[name] = [_form_value(declared, v) for v in values]
            else:
                raw[name] = _form_value(declared, values[0])
        extra = await walk_extras(state, role.walk, interval_alias(role, raw),
                            {role.text_input, image_input, "width", "height", "seed"})
        fields = extra_fields(extra, raw)
        extra[image_input], fields[image_input] = picture, "image"
        if mask is not None:
            if "mask" not in role.inputs:
                raise bad_request(f"walk '{role.walk}' takes no mask", "mask", "unsupported")
            extra["mask"], fields["mask"] = await _read_image(mask, "mask"), "mask"
        per = image_requests(state, role, prompt, size, n, extra, fields, seed)
        return await run_images(state, request, role, per)


def _form_value(declared: Mapping[str, Any] | None, text: str) -> Any:
    """A form field's text as the value its walk input's type wants, where it reads as one;
    otherwise the text itself, which the input's validation then refuses by name."""
    kind = (declared or {}).get("kind")
    if kind == "tensor":  # a list's elements (`key[]` fields), by the tensor's dtype
        kind = "int" if declared and declared.get("dtype") in ("i32", "i64", "u8") else "float"
    # None: an unknown field (refused by name) or a list such as cfg_interval, read as a float
    return form_value("float" if kind is None else kind, text)


async def _read_image(upload: Any, param: str) -> torch.Tensor:
    data = await upload.read()
    try:  # off the event loop: a large image takes seconds to decode
        return await asyncio.to_thread(decode_image, data)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param, "invalid_image") from None


__all__ = ["install", "interval_alias", "run_images", "size_inputs"]
