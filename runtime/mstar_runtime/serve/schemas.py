"""Request bodies of the OpenAI-compatible routes (pydantic), as `/openapi.json` documents them.

Only what this server does is declared; an OpenAI field it cannot honour is declared with
the values it accepts (`n: 1`, `response_format: wav | pcm`) so a client asking for more gets
a 400 naming the field rather than a silently different answer. Bodies allow extra keys:
a key that is an input of the route's walk is passed to it (the openai client's
`extra_body`, e.g. `{"seed": 3}`), typed by `input_annotation` exactly as the native route
types that input; any other key is a 400 naming it (checked by the route, which knows the walk).

Without the `serve` extra (pydantic comes with FastAPI) this module must still import,
because the layering test imports every runtime module; the classes are then inert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from mstar_runtime.control.validate import INT64_MAX, INT64_MIN

try:
    from pydantic import (
        AfterValidator,
        BaseModel,
        ConfigDict,
        Field,
        StrictBool,
        StrictFloat,
        StrictInt,
        StrictStr,
    )
except ImportError:  # pragma: no cover - the `serve` extra is not installed; serving says what to install
    BaseModel = object  # type: ignore[assignment,misc]

    def ConfigDict(**kw: Any) -> Any:  # noqa: N802 - mirrors pydantic's name
        return kw

    def Field(default: Any = None, **kw: Any) -> Any:  # noqa: N802
        return default

    def AfterValidator(f: Any) -> Any:  # noqa: N802
        return f

    StrictBool, StrictFloat, StrictInt, StrictStr = bool, float, int, str  # type: ignore[misc]

MAX_INPUT_CHARS = 4096  # OpenAI's limit for /v1/audio/speech input
MAX_PROMPT_CHARS = 32000  # OpenAI's limit for image prompts
SIZE_PATTERN = r"^(auto|[1-9][0-9]{0,4}x[1-9][0-9]{0,4})$"

MAX_STR = 1 << 20  # characters of a str walk input

Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
Finite = Annotated[StrictFloat, Field(allow_inf_nan=False)]
# the integer and float ranges of tensor element types: a value outside would wrap or overflow
INT_RANGES = {"u8": (0, 255), "i32": (-(2**31), 2**31 - 1), "i64": (INT64_MIN, INT64_MAX)}
FLOAT_MAX = {"f16": 65504.0, "bf16": 3.3895313892515355e38, "f32": 3.4028234663852886e38}


def valid_unicode(text: str) -> str:
    """`text` if it is valid Unicode; JSON's \\ud800-style escapes can spell a lone surrogate,
    which no tokenizer or encoder takes (UTF-8 has no form for it)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the text holds a lone surrogate (U+{ord(text[e.start]):04X}) at character "
                             f"{e.start}: it is not valid Unicode") from None
    return text


Text = Annotated[StrictStr, AfterValidator(valid_unicode)]


def input_annotation(t: Mapping[str, Any]) -> Any:
    """The pydantic type of a walk input of declared type `t`, for every route alike (the
    native route's body and the extra keys of the OpenAI routes): str (at most MAX_STR
    characters), int64, finite float, bool, a tensor as nested lists of its rank, an image
    as base64 text (decoded by the route); RGB frames, a u8 tensor [N, H, W, 3], also as a
    list of base64 images of one size (decoded and stacked by the route)."""
    kind = t["kind"]
    if kind == "str":
        return Annotated[Text, Field(max_length=MAX_STR)]
    if kind == "int":
        return Int64
    if kind == "float":
        return Finite
    if kind == "bool":
        return StrictBool
    if kind == "image":
        return Annotated[Text, Field(description="base64 PNG/JPEG, or a data:image/...;base64, URL")]
    dtype = t.get("dtype", "")
    dims = t.get("dims", [])
    frames = dtype == "u8" and len(dims) == 4 and dims[-1] == 3  # RGB frames [N, H, W, 3]: also as images
    if dtype in INT_RANGES:
        lo, hi = INT_RANGES[dtype]
        elem: Any = Annotated[StrictInt, Field(ge=lo, le=hi)]
    elif dtype == "bool":
        elem = StrictBool
    else:
        most = FLOAT_MAX.get(dtype)
        elem = Finite if most is None else Annotated[StrictFloat, Field(ge=-most, le=most, allow_inf_nan=False)]
    for _ in dims:
        elem = list[elem]
    if frames:
        images = Annotated[list[Annotated[Text, Field(description="base64 PNG/JPEG, or a data: URL")]],
                           Field(min_length=1)]
        return elem | images
    return elem


def input_adapters(program: Mapping[str, Any]) -> dict[str, Any]:
    """A pydantic TypeAdapter per input of a walk program (`input_annotation`)."""
    from pydantic import TypeAdapter

    return {p["name"]: TypeAdapter(input_annotation(p["type"])) for p in program["inputs"]}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------- chat
class ImageUrl(_Strict):
    url: Text = Field(description="a data: URL (data:image/png;base64,...); remote URLs are not fetched")
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(_Strict):
    data: Text = Field(description="base64 file bytes")
    format: Literal["wav", "mp3"] = Field(description="wav (PCM or float, any rate: resampled); mp3 is a 400")


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class ChatMessage(BaseModel):
    # extra keys of a message (`refusal: null`, `annotations`) are ignored: clients echo
    # whole assistant messages back as history
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[Annotated[TextPart | ImagePart | InputAudioPart, Field(discriminator="type")]] | None \
        = None
    name: Text | None = None


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class ResponseFormat(_Strict):
    type: Literal["text"] = Field(description="only plain text is served")


class VoiceRef(_Strict):
    id: Text


class ChatAudio(_Strict):
    voice: Text | VoiceRef = Field(description="the walk's voice (Qwen3-Omni: its speaker)")
    format: Literal["wav", "pcm16"] = Field(description="16-bit mono; a stream is pcm16 only (as OpenAI's)")


class ChatCompletionRequest(_Body):
    model: Text = Field(description="the served model id (GET /v1/models)")
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=INT64_MAX)] | None = None
    n: Literal[1] = Field(1, description="one choice per request")
    temperature: Annotated[StrictFloat, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[StrictFloat, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    seed: Int64 | None = None
    frequency_penalty: Annotated[StrictFloat, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    presence_penalty: Annotated[StrictFloat, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    stop: Text | list[Text] | None = Field(None, description="stop sequences are not supported: a 400 unless "
                                                            "empty (serve.chat)")
    logprobs: Literal[False] | None = Field(None, description="log-probabilities are not served")
    modalities: list[Literal["text", "audio"]] | None = Field(
        None, description='["text"], or ["text", "audio"] where the plan has a speech walk (serve.chat)')
    audio: ChatAudio | None = Field(None, description="with modalities ['text', 'audio']: the voice and format")
    response_format: ResponseFormat | None = None
    user: Text | None = None


# ----------------------------------------------------------------------------- speech
class SpeechRequest(_Body):
    model: Text = Field(description="the served model id (GET /v1/models)")
    input: Text = Field(min_length=1, max_length=MAX_INPUT_CHARS, description="the text to speak")
    voice: Text | VoiceRef | None = Field(None, description="passed to the walk's `voice` input, if it has one")
    instructions: Text | None = Field(None, description="only if the walk has an `instructions` input")
    response_format: Literal["wav", "pcm"] = Field(
        "wav", description="wav: 16-bit mono WAV; pcm: raw 16-bit little-endian mono samples")
    speed: Annotated[StrictFloat, Field(ge=0.25, le=4.0, allow_inf_nan=False)] = Field(
        1.0, description="only 1.0 unless the walk has a `speed` input")
    stream: StrictBool = Field(False, description="send audio chunks as they are decoded (chunked transfer)")
    stream_format: Literal["audio", "sse"] | None = Field(
        None, description="audio: raw chunks (as stream=true); sse: speech.audio.delta events")


# ----------------------------------------------------------------------------- images
class ImageGenerationRequest(_Body):
    model: Text = Field(description="the served model id (GET /v1/models)")
    prompt: Text = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    n: Annotated[StrictInt, Field(ge=1, le=10)] = 1
    size: Annotated[Text, Field(pattern=SIZE_PATTERN)] | None = Field(
        None, description="WxH (or auto); the walk's width/height, within the plan's latent grid (serve.images)")
    response_format: Literal["b64_json", "url"] | None = Field(
        None, description="images are returned inline only: 'url' is a 400 (there is no file host)")
    output_format: Literal["png"] | None = None
    quality: Text | None = None
    style: Text | None = None
    user: Text | None = None


# ----------------------------------------------------------------------------- native
class WalkRequestBase(_Strict):
    stream: StrictBool = Field(True, description="NDJSON lines as outputs are produced; false: one JSON object")
    timeout: Annotated[StrictFloat, Field(gt=0, le=86400, allow_inf_nan=False)] | None = Field(
        None, description="seconds before the request is failed with finish reason 'timeout'")


__all__ = ["ChatAudio", "ChatCompletionRequest", "ChatMessage", "ImageGenerationRequest", "InputAudioPart",
           "SpeechRequest", "WalkRequestBase", "input_adapters", "input_annotation"]
