"""BAGEL through the OpenAI routes (issue 14, section 5), with the real `openai` client against
one server (a subprocess) on the tiny BAGEL plan (`models/bagel/bagel.walk`, variant tiny,
`placements/cpu.yaml`, `--weights init`: the nodes' own random initialisation).

- `/v1/images/generations` -> walk `t2i`: a PNG of the requested size; sizes the plan cannot
  hold (the tiny plan's latent table is 4 x 4 tokens of 16 px: at most 64 px a side), `url`
  responses and flow / CFG fields out of their bounds are 400s naming the field.
- `/v1/images/edits` (multipart) -> walk `edit`: a PNG of the input's VAE-resized size; one
  image only, readable, no size of the client's choosing.
- `/v1/chat/completions`: with an `image_url` data URL -> walk `understand`, streamed (SSE)
  and whole; without one -> walk `chat`; remote URLs, two images, bad image data: 400s.

Skips, naming the missing classes, only while the BAGEL nodes the walk names are not all in
`mstar_models.bagel` (the plan cannot load without them).
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
openai = pytest.importorskip("openai", reason="the conformance tests need the openai client: pip install openai")
Image = pytest.importorskip("PIL.Image", reason="images need Pillow")

from test_server_support import ROOT, Server, metric, post, serving  # noqa: E402

WALK = ROOT / "models/bagel/bagel.walk"
MODEL = "bagel"
MAX_SIDE = 64  # tiny: max_latent_size 4 latent tokens of 16 px (VAE x8, latent patch 2)
STEPS = {"num_timesteps": 3}  # fewer than the tiny variant's default 9: quicker


def _bagel_plan(out: Path) -> Path:
    names = sorted(set(re.findall(r"= bagel\.(\w+) \{", WALK.read_text(encoding="utf-8"))))
    module = importlib.import_module("mstar_models.bagel")
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"mstar_models.bagel lacks {', '.join(missing)}, which the walk names"
    from mstarc.cli import main as mstarc

    plan = out / "bagel-tiny.plan"
    assert mstarc(["compile", str(WALK), "--variant", "tiny", "-p", str(ROOT / "placements/cpu.yaml"),
                   "-o", str(plan)]) == 0
    return plan


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(_bagel_plan(tmp_path_factory.mktemp("bagel")), "--request-timeout", "120") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def png_of(width: int, height: int, colour: tuple[int, int, int] = (200, 40, 10), fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img = Image.new("RGB", (width, height), colour)
    for x in range(width):  # a gradient, so the resize has something to resample
        img.putpixel((x, x * height // width), (x * 255 // width, 255, 0))
    img.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def pixels(b64_json: str) -> np.ndarray:
    return np.asarray(decoded(b64_json), dtype=np.int32)


def decoded(b64_json: str) -> Image.Image:
    img = Image.open(io.BytesIO(base64.b64decode(b64_json)))
    assert img.format == "PNG" and img.mode == "RGB"
    return img


def bad_request(fn, *args, **kwargs) -> dict:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as info:
        fn(*args, **kwargs)
    body = info.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}, body
    return body


def ask(question: str, image: bytes, mime: str = "image/png") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image, mime)}},
                                         {"type": "text", "text": question}]}]


# ----------------------------------------------------------------------------- the plan's limits
@pytest.mark.parametrize(("variant", "placement", "grid", "timesteps", "tokens"), [
    ("tiny", "cpu.yaml", (16, 64, 4), 9, 64),
    ("real", "h200x1.yaml", (16, 1024, 64), 101, 1024),  # BAGEL's 1024 px, 50 steps by default, 1024 think tokens
])
def test_limits_come_from_the_plan(tmp_path: Path, variant: str, placement: str, grid: tuple, timesteps: int,
                                   tokens: int) -> None:
    """What the routes refuse is read from the compiled plan's config, whichever variant (no nodes needed)."""
    from mstar_runtime.control.bounds import ImageGrid, image_grid, max_timesteps
    from mstar_runtime.plan import planfile
    from mstarc.cli import main as mstarc

    plan = tmp_path / f"bagel-{variant}.plan"
    assert mstarc(["compile", str(WALK), "--variant", variant, "-p", str(ROOT / "placements" / placement),
                   "-o", str(plan)]) == 0
    config = planfile.read(plan)["model"]["config"]
    assert image_grid(config) == ImageGrid(*grid)
    assert max_timesteps(config) == timesteps and config["max_text_tokens"] == tokens


# ----------------------------------------------------------------------------- generations: errors
@pytest.mark.parametrize("size", ["1024x1024", "80x64", "64x80", "48x40", "8x8", "17x16"])
def test_sizes_the_plan_cannot_hold_name_the_limit(client: openai.OpenAI, size: str) -> None:
    err = bad_request(client.images.generate, model=MODEL, prompt="a red square", size=size, extra_body=STEPS)
    assert (err["param"], err["code"]) == ("size", "unsupported_size")
    assert size in err["message"] and f"multiple of 16 from 16 to {MAX_SIDE} px" in err["message"]


@pytest.mark.parametrize(("extra", "param", "says"), [
    ({"num_timesteps": 10}, "num_timesteps", "from 2 to 9"),
    ({"num_timesteps": 1}, "num_timesteps", "from 2 to 9"),
    ({"num_timesteps": "three"}, "num_timesteps", "integer"),
    ({**STEPS, "seed": 2**70}, "seed", "9223372036854775807"),
    ({**STEPS, "cfg_text_scale": -1.0}, "cfg_text_scale", "0 <= cfg_text_scale <= 100"),
    ({**STEPS, "cfg_img_scale": 1e9}, "cfg_img_scale", "<= 100"),
    ({**STEPS, "timestep_shift": 0.0}, "timestep_shift", "0 < timestep_shift"),
    ({**STEPS, "cfg_interval": [0.8, 0.2]}, "cfg_interval", "start <= end"),
    ({**STEPS, "cfg_interval": [0.0, 1.5]}, "cfg_interval", "cfg_interval_end <= 1"),
    ({**STEPS, "cfg_interval": [0.1]}, "cfg_interval", "[start, end]"),
    ({**STEPS, "cfg_interval": [0.1, 0.9], "cfg_interval_end": 0.9}, "cfg_interval", "not both"),
    ({**STEPS, "cfg_interval_end": 0.2}, "cfg_interval_end", "start <= end"),  # against the default start 0.4
    ({**STEPS, "cfg_renorm_type": "none"}, "cfg_renorm_type", "global, channel, text_channel"),
    ({**STEPS, "cfg_renorm_min": 1.5}, "cfg_renorm_min", "<= 1"),
    ({**STEPS, "height": 32}, "height", "unknown field"),  # size's business
    ({**STEPS, "guidance": 3.0}, "guidance", "unknown field"),
])
def test_generation_fields_are_typed_and_bounded(client: openai.OpenAI, extra: dict, param: str, says: str) -> None:
    err = bad_request(client.images.generate, model=MODEL, prompt="a red square", size="32x32", extra_body=extra)
    assert err["param"] == param and says in err["message"], err


def test_generation_request_fields(client: openai.OpenAI) -> None:
    err = bad_request(client.images.generate, model=MODEL, prompt="x", response_format="url", extra_body=STEPS)
    assert (err["param"], err["code"]) == ("response_format", "unsupported") and "b64_json" in err["message"]
    assert bad_request(client.images.generate, model=MODEL, prompt="x", n=11, extra_body=STEPS)["param"] == "n"
    assert bad_request(client.images.generate, model=MODEL, prompt="", extra_body=STEPS)["param"] == "prompt"
    assert bad_request(client.images.generate, model=MODEL, prompt="x", size="big", extra_body=STEPS)["param"] == "size"
    with pytest.raises(openai.NotFoundError):
        client.images.generate(model="dall-e-3", prompt="x", extra_body=STEPS)


def test_native_route_checks_the_same_bounds(server: Server) -> None:
    # the real model's 1024 x 1024 and 50 timesteps are more than the tiny plan holds: one 400 says both
    status, raw = post(server.base + "/v1/walks/t2i", {"inputs": {"prompt": "x", "height": 1024, "width": 1024,
                                                                  "num_timesteps": 50}, "stream": False})
    err = json.loads(raw)["error"]
    assert status == 400 and (err["param"], err["code"]) == ("inputs.width", "unsupported_size"), err
    assert err["message"].startswith("inputs.width and inputs.height: 1024x1024") and "from 2 to 9" in err["message"]
    status, raw = post(server.base + "/v1/walks/t2i", {"inputs": {"prompt": "x", "height": 32, "width": 32,
                                                                  "num_timesteps": 12}})
    assert status == 400 and json.loads(raw)["error"]["param"] == "inputs.num_timesteps"


# ----------------------------------------------------------------------------- edits: errors
@pytest.mark.parametrize(("kwargs", "param", "code"), [
    ({"image": [("a.png", png_of(40, 30), "image/png"), ("b.png", png_of(40, 30), "image/png")]},
     "image", "too_many_images"),
    ({"image": ("a.png", b"not an image at all", "image/png")}, "image", "invalid_image"),
    ({"size": "32x32"}, "size", "unsupported_size"),  # the edit keeps the input's (resized) size
    ({"response_format": "url"}, "response_format", "unsupported"),
    ({"extra_body": {"num_timesteps": "many"}}, "num_timesteps", "invalid_value"),
    ({"extra_body": {"num_timesteps": 40}}, "num_timesteps", "out_of_range"),
    ({"extra_body": {**STEPS, "cfg_renorm_type": "sideways"}}, "cfg_renorm_type", "invalid_value"),
    ({"extra_body": {**STEPS, "cfg_interval": [0.9, 0.1]}}, "cfg_interval", "out_of_range"),
    ({"extra_body": {**STEPS, "strength": 0.5}}, "strength", "unknown_field"),
])
def test_edit_errors_name_the_field(client: openai.OpenAI, kwargs: dict, param: str, code: str) -> None:
    args = {"model": MODEL, "prompt": "make it blue", "image": ("in.png", png_of(40, 30), "image/png"),
            "extra_body": STEPS, **kwargs}
    err = bad_request(client.images.edit, **args)
    assert (err["param"], err["code"]) == (param, code), err


# ----------------------------------------------------------------------------- chat: errors
@pytest.mark.parametrize(("content", "param", "code"), [
    ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, {"type": "text", "text": "?"}],
     "messages[0].content[0].image_url.url", "invalid_image"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}],
     "messages[0].content[0].image_url.url", "invalid_image"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}],
     "messages[0].content[0].image_url.url", "invalid_image"),
    ([{"type": "text", "text": "compare"}, {"type": "image_url", "image_url": {"url": data_url(png_of(20, 20))}},
      {"type": "image_url", "image_url": {"url": data_url(png_of(20, 20))}}],
     "messages[0].content[2]", "too_many_images"),
])
def test_chat_image_errors(client: openai.OpenAI, content: list, param: str, code: str) -> None:
    err = bad_request(client.chat.completions.create, model=MODEL, messages=[{"role": "user", "content": content}])
    assert (err["param"], err["code"]) == (param, code), err


def test_chat_token_limit_is_the_plans(client: openai.OpenAI) -> None:
    for messages in ([{"role": "user", "content": "hi"}], ask("what is this?", png_of(20, 20))):
        err = bad_request(client.chat.completions.create, model=MODEL, messages=messages, max_tokens=65)
        assert (err["param"], err["code"]) == ("max_tokens", "max_tokens_too_large")
        assert "max_text_tokens 64" in err["message"]


# ----------------------------------------------------------------------------- end to end
def test_text_to_image(client: openai.OpenAI) -> None:
    r = client.images.generate(model=MODEL, prompt="a red square on a white table", size="48x32",
                               extra_body={**STEPS, "seed": 7})
    assert len(r.data) == 1 and r.size == "48x32" and r.output_format == "png"
    assert decoded(r.data[0].b64_json).size == (48, 32)  # (W, H) as asked
    # n = 2: seeds 7 and 8, so the images differ; the first is the single one (same seed), up to
    # float rounding when the two requests' denoise steps ran as one batch (a level of 255 at most)
    two = client.images.generate(model=MODEL, prompt="a red square on a white table", size="48x32", n=2,
                                 extra_body={**STEPS, "seed": 7})
    single, first, second = (pixels(d.b64_json) for d in (r.data[0], *two.data))
    assert np.abs(first - single).max() <= 1 and np.abs(second - first).mean() > 10
    # no size (auto): the walk's 1024 x 1024 does not fit the tiny plan, so its largest square
    auto = client.images.generate(model=MODEL, prompt="x", extra_body={"num_timesteps": 2,
                                                                       "cfg_interval": [0.0, 1.0]})
    assert decoded(auto.data[0].b64_json).size == (MAX_SIDE, MAX_SIDE)


def test_edit_keeps_the_resized_input_size(client: openai.OpenAI) -> None:
    # BAGEL's VAE transform at tiny size: long side <= 64, short side >= 32, multiples of 16.
    # 40 x 30: scale max(min(64/40, 1), 32/30) = 16/15 -> 42.7 x 32 -> 48 x 32.
    for fmt, mime in (("PNG", "image/png"), ("JPEG", "image/jpeg")):
        e = client.images.edit(model=MODEL, image=("in." + fmt.lower(), png_of(40, 30, fmt=fmt), mime),
                               prompt="make it blue", extra_body={**STEPS, "cfg_renorm_type": "global"})
        assert decoded(e.data[0].b64_json).size == (48, 32) and e.size == "48x32"
    # one image sent as image[] (the client's list form) is fine too; 128 x 100 -> 64 x 48 (long side capped)
    e = client.images.edit(model=MODEL, image=[("in.png", png_of(128, 100), "image/png")], prompt="x",
                           extra_body={**STEPS, "cfg_interval": [0.0, 0.5], "seed": 3})
    assert decoded(e.data[0].b64_json).size == (64, 48)


def test_understand_streams_text(client: openai.OpenAI, server: Server) -> None:
    before = metric(server.base, "mstar_requests_total", 'walk="understand",outcome="finished"')
    messages = ask("What is in this picture?", png_of(40, 30))
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    assert 1 <= whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == choice.message.content  # greedy
    assert with_choices[-1].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert metric(server.base, "mstar_requests_total", 'walk="understand",outcome="finished"') == before + 2
    # a JPEG data URL is an image too
    jpeg = client.chat.completions.create(model=MODEL, messages=ask("and this?", png_of(30, 40, fmt="JPEG"),
                                                                    "image/jpeg"), max_tokens=4)
    assert jpeg.choices[0].finish_reason in ("stop", "length")


def test_chat_without_an_image(client: openai.OpenAI, server: Server) -> None:
    before = metric(server.base, "mstar_requests_total", 'walk="chat",outcome="finished"')
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert whole.choices[0].finish_reason in ("stop", "length") and 1 <= whole.usage.completion_tokens <= 8
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content
    assert metric(server.base, "mstar_requests_total", 'walk="chat",outcome="finished"') == before + 2


def test_a_reply_that_opens_an_image_is_still_a_reply(client: openai.OpenAI, server: Server) -> None:
    """A chat reply that ends in <|vision_start|> moves on to `draw` (the walk's transition),
    with draw's defaults: the request goes on after the reply is complete. The chat route
    answers the reply (finish reason "stop"), whatever that walk does."""
    for prompt in ("hi", "draw a cat", "a", "b c d", "an image please"):
        status, raw = post(server.base + "/v1/walks/chat", {"inputs": {"prompt": prompt}, "stream": False})
        if status != 200 or json.loads(raw)["outputs"].get("image_start") is True:
            break
    else:
        pytest.skip("no reply of these random weights opens an image")
    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model=MODEL, messages=messages)
    assert whole.choices[0].finish_reason == "stop"
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == "stop"
