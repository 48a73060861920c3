"""Qwen3-Omni's processor as a stateless node: `build(prompt, system, audio, image, history) -> (ids,
mel, clips, pixels, grid)` and `detokenize(token) -> piece`.

What transformers 5.24's `Qwen3OmniMoeProcessor` does for one conversation, written here:
- Chat template: messages `[system (when not empty), the earlier turns of `history` (a JSON
  list of `{"role", "content", "audio"}`; a user turn's `audio` is how many samples at the
  front of the `audio` input are its clip, in order), user: [image?, audio?, text]]` rendered
  with `add_generation_prompt=True` in a sandboxed jinja2 environment set up as transformers'
  (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, a `tojson` that does not
  escape HTML). The template is the checkpoint's own (`chat_template.json`, else
  `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`); without a
  checkpoint it is `BUNDLED_TEMPLATE`, a ChatML layout with one
  `<|vision_start|><|image_pad|><|vision_end|>` / `<|audio_start|><|audio_pad|><|audio_end|>`
  placeholder per part, in the parts' order.
- Tokens: the rendered text is tokenized, then each `<|audio_pad|>` becomes one id per audio
  token and each `<|image_pad|>` one per merged image token, which is what tokenizing HF's
  expanded string gives (added tokens are split off before BPE). A prompt that itself
  contains a placeholder token is refused.
- Audio (16 kHz mono samples; the history's clips, then the new turn's) -> one Whisper-style
  log-mel per clip, joined along time (`clips`: the frames of each), `feature_size` bins: hann-window STFT
  (n_fft 400, hop 160, centred, reflect padding), the last frame dropped, power spectrum
  times a slaney-normalised mel filter bank (0 to sr / 2), log10 clamped at 1e-10, floored
  at max - 8, then (x + 4) / 4. Frames = samples // hop. Audio tokens = the encoder's
  `encoded_length(frames)`.
- Image (u8 [H, W, 3]) -> `smart_resize` to multiples of patch * merge within
  [min_pixels, max_pixels], a PIL bicubic resize, x / 255, (x - mean) / std, then flattened
  patches [h * w, 3 * temporal * patch * patch] in merge-block order (each patch repeated
  over the temporal patch), grid (1, h, w) in patches. Image tokens = h * w / merge^2.
The sizes come from the checkpoint's `preprocessor_config.json` when there is one, else from
transformers' class defaults (OpenAI CLIP mean / std; min / max pixels 3136 / 12845056 as in
the Qwen-Omni preprocessor configs [unverified for Qwen3-Omni]) and the model config (patch,
merge, temporal patch, mel bins). Node settings of the same names override both.

Detokenize: ids -> text with special tokens dropped: every added token (`controls_special`,
also those Qwen's tokenizer marks non-special, such as `<|fim_pad|>` and `<tool_call>`). A stream chunk (`token:context` given:
the walk's left_context(1, 4) stream of generated ids) returns the text its new id adds,
decode(all) minus decode(history); a character that byte-level BPE split over several ids
is held back until its last id, so the pieces join to one decode of the reply (an incomplete
character at the very end never comes).

Tokenizer: the checkpoint's `tokenizer.json`, else its `vocab.json` + `merges.txt` (+ the
added tokens of `tokenizer_config.json`) in Qwen2's shape; without a checkpoint, the bundled
`tokenizer_tiny.json` (tools/make_qwen3_omni_tiny_tokenizer.py: Qwen's shape, 512 ids, Qwen's
33 added tokens at 479..511). Token ids: `token_ids(vocab)` (Qwen's when the vocabulary holds
them, else the bundled tokenizer's, `TINY_IDS`), overridden by model-config values under the
thinker's names (`audio_token_id`, `user_token_id`, ...); the bundled tokenizer is relabelled
to those ids, and a checkpoint's tokenizer must agree with them (else NodeError).

The node holds no parameters or buffers, so the server copies it to count prompt tokens and
render text (mstar_runtime/serve/text.py).
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from PIL import Image
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from mstar_models.qwen3_omni.audio_encoder import N_WINDOW, encoded_length
from mstar_models.tokenizers import load_tokenizer
from mstar_runtime.ops import node

BUNDLED_TOKENIZER = Path(__file__).resolve().parent / "tokenizer_tiny.json"
QWEN2_SPLIT = (  # transformers' Qwen2Tokenizer PRETOKENIZE_REGEX
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): every byte is written as one character, the printable
    Latin-1 ones as themselves and the others as U+0100 onwards in byte order; char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


BYTE_OF = _byte_alphabet()

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

BUNDLED_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set ns = namespace(text='') %}\n"
    "        {%- for part in message.content %}\n"
    "            {%- if part.type == 'image' or 'image' in part or 'image_url' in part %}\n"
    "                {%- set ns.text = ns.text ~ '<|vision_start|><|image_pad|><|vision_end|>' %}\n"
    "            {%- elif part.type == 'audio' or 'audio' in part or 'input_audio' in part %}\n"
    "                {%- set ns.text = ns.text ~ '<|audio_start|><|audio_pad|><|audio_end|>' %}\n"
    "            {%- elif part.type == 'video' or 'video' in part %}\n"
    "                {%- set ns.text = ns.text ~ '<|vision_start|><|video_pad|><|vision_end|>' %}\n"
    "            {%- elif part.type == 'text' %}\n"
    "                {%- set ns.text = ns.text ~ part.text %}\n"
    "            {%- endif %}\n"
    "        {%- endfor %}\n"
    "        {%- set content = ns.text %}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


# ------------------------------------------------------------------------------ token ids
@dataclass(frozen=True)
class TokenIds:
    """The ids the Qwen3-Omni nodes agree on (docs/models/qwen3_omni.md, Facts: the released config's thinker and top-level ids)."""

    endoftext: int
    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    image: int  # <|image_pad|>
    video: int  # <|video_pad|>
    audio_start: int
    audio_end: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    audio: int  # <|audio_pad|>
    system: int
    user: int
    assistant: int


REAL_IDS = TokenIds(151643, 151644, 151645, 151652, 151653, 151655, 151656, 151669, 151670, 151671, 151672, 151673,
                    151675, 8948, 872, 77091)
TINY_OFFSET = 151643 - 479  # the bundled tokenizer keeps Qwen's added tokens at 479..511, in order
TINY_ROLES = {"system": 273, "user": 265, "assistant": 298}  # their ids in tokenizer_tiny.json
TINY_IDS = TokenIds(**{k: (v - TINY_OFFSET if v > 151000 else TINY_ROLES[k])
                       for k, v in REAL_IDS.__dict__.items()})
TOKEN_NAMES = {"endoftext": "<|endoftext|>", "im_start": "<|im_start|>", "im_end": "<|im_end|>",
               "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>", "image": "<|image_pad|>",
               "video": "<|video_pad|>", "audio_start": "<|audio_start|>", "audio_end": "<|audio_end|>",
               "tts_pad": "<tts_pad>", "tts_bos": "<tts_text_bos>", "tts_eos": "<tts_text_eod>",
               "audio": "<|audio_pad|>", "system": "system", "user": "user", "assistant": "assistant"}
# the model-config names of these ids (the thinker's and talker's, mstar_models.qwen3_omni.tokens)
CONFIG_KEYS = {f: f"{f}_token_id" for f in TOKEN_NAMES if f != "endoftext"}


def token_ids(vocab: int) -> TokenIds:
    """Qwen's ids when the vocabulary holds them (the released 152064), else the bundled tiny tokenizer's."""
    if vocab > REAL_IDS.audio:
        return REAL_IDS
    if vocab < 512:
        raise ValueError(f"a vocabulary of {vocab} ids cannot hold Qwen3-Omni's special tokens (tiny needs 512)")
    return TINY_IDS


# ------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Features:
    """Audio and image preprocessing sizes (module docstring)."""

    sampling_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    feature_size: int = 128
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 3136
    max_pixels: int = 12845056
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    max_audio_seconds: float = 300.0

    def updated(self, values: Mapping[str, Any]) -> Features:
        """With the known keys of a preprocessor_config.json (or node settings) applied."""
        out: dict[str, Any] = {}
        size = values.get("size")
        if isinstance(size, Mapping):  # transformers >= 4.5x spells the pixel bounds as `size`
            values = {**values, "min_pixels": size.get("shortest_edge", values.get("min_pixels")),
                      "max_pixels": size.get("longest_edge", values.get("max_pixels"))}
        for name, cur in self.__dict__.items():
            v = values.get(name)
            if v is None:
                continue
            out[name] = tuple(float(x) for x in v) if isinstance(cur, tuple) else type(cur)(v)
        return replace(self, **out)


def _features(spec: node.NodeSpec, checkpoint: Mapping[str, Any] | None = None) -> Features:
    """Defaults, then the model config, then a checkpoint's preprocessor_config.json, then node settings;
    the patch and mel sizes must still be what the encoders take."""
    cfg = spec.config
    f = Features().updated({"feature_size": cfg.get("mel_bins"), "patch_size": cfg.get("vis_patch"),
                            "merge_size": cfg.get("vis_merge"), "temporal_patch_size": cfg.get("vis_temporal_patch")})
    f = f.updated(checkpoint or {}).updated(spec.settings)
    want = {"feature_size": cfg.get("mel_bins"), "patch_size": cfg.get("vis_patch"), "merge_size": cfg.get("vis_merge"),
            "temporal_patch_size": cfg.get("vis_temporal_patch")}
    for name, value in want.items():
        if value is not None and getattr(f, name) != value:
            raise node.NodeError(f"node '{spec.name}': preprocessing {name} is {getattr(f, name)}, but the model's "
                                 f"encoders take {value}")
    return f


# ------------------------------------------------------------------------------ mel
def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale: linear below 1 kHz (3 / 200 mel per Hz), logarithmic above."""
    mel = f / (200.0 / 3)
    logstep = math.log(6.4) / 27.0
    return torch.where(f >= 1000.0, 15.0 + torch.log(f.clamp(min=1e-10) / 1000.0) / logstep, mel)


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    logstep = math.log(6.4) / 27.0
    return torch.where(m >= 15.0, 1000.0 * torch.exp(logstep * (m - 15.0)), m * (200.0 / 3))


def mel_filters(n_fft: int, n_mels: int, sampling_rate: int) -> torch.Tensor:
    """[n_fft // 2 + 1, n_mels] triangular slaney-normalised filters from 0 Hz to sr / 2, in fp32."""
    fft_freqs = torch.linspace(0, sampling_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = _mel_to_hz(torch.linspace(float(_hz_to_mel(torch.tensor(0.0, dtype=torch.float64))),
                                      float(_hz_to_mel(torch.tensor(sampling_rate / 2, dtype=torch.float64))),
                                      n_mels + 2, dtype=torch.float64))
    lower = (fft_freqs[:, None] - edges[None, :-2]) / (edges[1:-1] - edges[:-2])[None]
    upper = (edges[None, 2:] - fft_freqs[:, None]) / (edges[2:] - edges[1:-1])[None]
    filters = torch.clamp(torch.minimum(lower, upper), min=0.0)
    return (filters * (2.0 / (edges[2:] - edges[:-2]))[None]).float()


def log_mel(wave: torch.Tensor, filters: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
    """[samples] fp32 -> [n_mels, samples // hop] log-mel features (module docstring)."""
    stft = torch.stft(wave, n_fft, hop, window=torch.hann_window(n_fft), return_complex=True)
    power = (stft[..., :-1].abs() ** 2).contiguous()
    log = torch.clamp(filters.T @ power, min=1e-10).log10()
    log = torch.maximum(log, log.max() - 8.0)
    return (log + 4.0) / 4.0


# ------------------------------------------------------------------------------ image
def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Height and width, multiples of `factor`, near the image's aspect ratio, with a pixel count in
    [min_pixels, max_pixels] (Qwen2-VL's rule)."""
    if max(height, width) > 200 * min(height, width):
        raise node.RequestError(f"image aspect ratio must be below 200, got {height} x {width}", "image")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_patches(image: np.ndarray, f: Features) -> tuple[np.ndarray, tuple[int, int, int]]:
    """u8 [H, W, 3] -> (patches [h * w, 3 * T * p * p] fp32 in merge-block order, grid (1, h, w))."""
    p, m, t = f.patch_size, f.merge_size, f.temporal_patch_size
    height, width = smart_resize(image.shape[0], image.shape[1], p * m, f.min_pixels, f.max_pixels)
    resized = np.asarray(Image.fromarray(image).resize((width, height), resample=Image.Resampling.BICUBIC))
    x = (resized.astype(np.float64) * f.rescale_factor).astype(np.float32)
    x = (x - np.asarray(f.image_mean, dtype=np.float32)) / np.asarray(f.image_std, dtype=np.float32)
    gh, gw = height // p, width // p
    x = x.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (block row, block col, row in block, col in block, C, py, px)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * t * p * p)), (1, gh, gw)


# ------------------------------------------------------------------------------ tokenizer
def controls_special(tok: Tokenizer) -> Tokenizer:
    """`tok` with every added token marked special, so that decoding with special tokens
    skipped drops them all. Qwen's tokenizer marks 12 of its 33 added tokens non-special
    (`<tool_call>`, `<|fim_pad|>`, `<|repo_name|>`, `<think>`, ...), which transformers'
    decode(skip_special_tokens=True) then prints; none is text a reply means to say (the
    served walks take no tools and do not think), and a tiny model prints them at random.
    Encoding is unchanged: added tokens are split off the input either way."""
    plain = [t for t in tok.get_added_tokens_decoder().values() if not t.special]
    tok.add_special_tokens([AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                                       normalized=t.normalized, special=True) for t in plain])
    return tok


def bundled_tokenizer(vocab: int, ids: TokenIds | None = None) -> Tokenizer:
    """tokenizer_tiny.json, relabelled to Qwen's ids when `token_ids(vocab)` is the real table, then to
    `ids` (a token whose id another one takes swaps ids with it, so the vocabulary stays one-to-one)."""
    base = token_ids(vocab)
    ids = ids or base
    if base is TINY_IDS and ids == TINY_IDS:
        return load_tokenizer(BUNDLED_TOKENIZER)
    spec = json.loads(BUNDLED_TOKENIZER.read_text(encoding="utf-8"))
    id_of: dict[str, int] = dict(spec["model"]["vocab"])  # the added tokens are in it too
    if base is REAL_IDS:
        for added in spec["added_tokens"]:
            id_of[added["content"]] += TINY_OFFSET
        for role in TINY_ROLES:
            id_of[role] = getattr(REAL_IDS, role)
    token_at = {i: t for t, i in id_of.items()}
    for field, name in TOKEN_NAMES.items():
        old, new = id_of[name], getattr(ids, field)
        if old == new:
            continue
        other = token_at.pop(new, None)
        id_of[name], token_at[new] = new, name
        if other is not None:
            id_of[other], token_at[old] = old, other
        else:
            del token_at[old]
    spec["model"]["vocab"] = id_of
    for added in spec["added_tokens"]:
        added["id"] = id_of[added["content"]]
    return Tokenizer.from_str(json.dumps(spec))


def configured_ids(spec: node.NodeSpec, vocab: int) -> TokenIds:
    """`token_ids(vocab)` with the ids the model config (or the node's arch line) sets under the
    thinker's names (`audio_token_id`, `user_token_id`, ...: mstar_models.qwen3_omni.tokens)."""
    values = dict(token_ids(vocab).__dict__)
    for field in values:
        key = CONFIG_KEYS.get(field)
        for source in (spec.arch_args, spec.config):
            if key is not None and key in source:
                values[field] = int(source[key])
                break
    bad = {k: v for k, v in values.items() if not 0 <= v < vocab}
    if bad:
        raise ValueError(f"token ids {bad} lie outside the vocabulary of {vocab}")
    if len(set(values.values())) != len(values):
        raise ValueError(f"token ids must be distinct, got {values}")
    return TokenIds(**values)


def qwen2_tokenizer(folder: Path) -> Tokenizer:
    """A Qwen2-shaped tokenizer from `vocab.json` + `merges.txt` and the added tokens of `tokenizer_config.json`."""
    try:
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")) \
            if (folder / "tokenizer_config.json").is_file() else {}
    except (OSError, ValueError) as e:
        raise node.NodeError(f"cannot read the tokenizer files in '{folder}': {e}") from None
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    added = config.get("added_tokens_decoder", {})
    for _, t in sorted(added.items(), key=lambda kv: int(kv[0])):
        token = AddedToken(t["content"], single_word=t.get("single_word", False), lstrip=t.get("lstrip", False),
                           rstrip=t.get("rstrip", False), normalized=t.get("normalized", False),
                           special=t.get("special", True))
        tok.add_tokens([token])
    for i, t in added.items():
        if tok.token_to_id(t["content"]) != int(i):
            raise node.NodeError(f"tokenizer in '{folder}': added token {t['content']!r} got id "
                                 f"{tok.token_to_id(t['content'])}, its tokenizer_config.json says {i}")
    return tok


def checkpoint_template(folder: Path) -> str | None:
    """The checkpoint's chat template: chat_template.json, chat_template.jinja, tokenizer_config.json."""
    try:
        if (folder / "chat_template.json").is_file():
            value = json.loads((folder / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
            if isinstance(value, str):
                return value
        if (folder / "chat_template.jinja").is_file():
            return (folder / "chat_template.jinja").read_text(encoding="utf-8")
        if (folder / "tokenizer_config.json").is_file():
            value = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
            if isinstance(value, str):
                return value
    except (OSError, ValueError) as e:
        raise node.NodeError(f"cannot read the chat template in '{folder}': {e}") from None
    return None


def compile_template(source: str) -> jinja2.Template:
    """A chat template in the sandboxed environment transformers renders chat templates in."""
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise node.NodeError(f"the chat template does not compile: {e}") from None


# ------------------------------------------------------------------------------ node
class Processor(node.StatelessNode):
    """build(prompt, system, audio, image) -> (ids, mel, pixels, grid); detokenize(token) -> (piece)."""

    def __init__(self, spec: node.NodeSpec):
        super().__init__(spec)
        vocab = int(spec.config.get("vocab", REAL_IDS.audio + 1))
        try:
            self.ids = configured_ids(spec, vocab)
        except ValueError as e:
            raise node.NodeError(f"node '{spec.name}': {e}") from None
        self.vocab = vocab
        self.n_window = int(spec.config.get("audio_n_window", N_WINDOW))
        self.tokenizer = controls_special(bundled_tokenizer(vocab, self.ids))
        self._added: dict[int, AddedToken] = {}
        self._added_of: Tokenizer | None = None  # the tokenizer `_added` was read from
        self.template_source = BUNDLED_TEMPLATE
        self.template = compile_template(BUNDLED_TEMPLATE)
        self._set_features(_features(spec))

    def _set_features(self, features: Features) -> None:
        self.features = features
        # a plain attribute, not a buffer: the server copies only nodes without tensors of their own
        self.filters = mel_filters(features.n_fft, features.feature_size, features.sampling_rate)

    def on_weights(self, source: str) -> None:
        """Called by the weights loader with the weights source: the checkpoint's tokenizer, chat
        template and preprocessor sizes, where the folder has them."""
        folder = Path(source)
        if (folder / "tokenizer.json").is_file():
            self._use_tokenizer(load_tokenizer(folder / "tokenizer.json"), folder)
        elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            self._use_tokenizer(qwen2_tokenizer(folder), folder)
        template = checkpoint_template(folder)
        if template is not None:
            self.template, self.template_source = compile_template(template), template
        pre = folder / "preprocessor_config.json"
        if pre.is_file():
            try:
                values = json.loads(pre.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise node.NodeError(f"cannot read '{pre}': {e}") from None
            self._set_features(_features(self.spec, values))

    def _use_tokenizer(self, tok: Tokenizer, folder: Path) -> None:
        for field, name in TOKEN_NAMES.items():
            want, got = getattr(self.ids, field), tok.token_to_id(name)
            if got != want:
                raise node.NodeError(f"node '{self.spec.name}': the tokenizer in '{folder}' has {name!r} at id {got}; "
                                     f"the model's other nodes use {want} (vocab {self.vocab})")
        self.tokenizer = controls_special(tok)

    # ---- build
    def messages(self, prompt: str, system: str, audio: bool, image: bool,
                 history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The conversation the template renders (module docstring): the system message, the
        earlier turns of `history` (`_history`), then the user's turn."""
        parts: list[dict[str, Any]] = ([{"type": "image"}] if image else []) + ([{"type": "audio"}] if audio else [])
        parts.append({"type": "text", "text": prompt})
        out: list[dict[str, Any]] = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system \
            else []
        for turn in history or ():
            heard = [{"type": "audio"}] if turn["audio"] else []
            out.append({"role": turn["role"], "content": heard + [{"type": "text", "text": turn["content"]}]})
        return out + [{"role": "user", "content": parts}]

    def _history(self, entry: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The `history` input: a JSON list of the conversation's earlier turns, each
        `{"role": "user" | "assistant" | "system", "content": text, "audio": samples}`; a user
        turn's `audio` (default 0) is how many samples of the `audio` input are its clip, the
        turns' clips first and in order, the rest the new turn's."""
        raw = _text(entry, "history")
        if not raw.strip():
            return []
        try:
            turns = json.loads(raw)
        except ValueError as e:
            raise node.RequestError(f"history is not valid JSON: {e}", "history") from None
        if not isinstance(turns, list):
            raise node.RequestError("history must be a JSON list of turns", "history")
        out = []
        for i, t in enumerate(turns):
            ok = isinstance(t, dict) and set(t) <= {"role", "content", "audio"} \
                and t.get("role") in ("user", "assistant", "system") and isinstance(t.get("content", ""), str)
            n = t.get("audio", 0) if isinstance(t, dict) else 0
            if not ok or isinstance(n, bool) or not isinstance(n, int) or n < 0 or (n and t["role"] != "user"):
                raise node.RequestError(f"history[{i}] must be {{\"role\": \"user\" | \"assistant\" | \"system\", "
                                        "\"content\": text, \"audio\": samples (user turns)}", "history")
            out.append({"role": t["role"], "content": t.get("content", ""), "audio": n})
        return out

    def _clips(self, wave: torch.Tensor | None, history: list[dict[str, Any]]) -> tuple[list[torch.Tensor], bool]:
        """The `audio` input cut into the history's clips and the new turn's (module docstring);
        whether the new turn has one."""
        sizes = [t["audio"] for t in history if t["audio"]]
        total = 0 if wave is None else int(wave.shape[0])
        if sum(sizes) > total:
            raise node.RequestError(f"history's turns hold {sum(sizes)} samples of audio, but audio has {total}",
                                    "history")
        least = self.features.n_fft // 2 + 1
        if any(n < least for n in sizes):
            raise node.RequestError(f"a history turn's audio is under {least} samples", "history")
        rest = total - sum(sizes)
        if 0 < rest < least:
            raise node.RequestError(f"audio after the history's clips is {rest} samples; at least {least} are needed",
                                    "audio")
        if wave is None:
            return [], False
        clips = list(torch.split(wave, [*sizes, rest])) if rest else list(torch.split(wave, sizes))
        return clips, rest > 0

    def render(self, messages: list[dict[str, Any]]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, tools=None, documents=None,
                                        bos_token=None, eos_token="<|im_end|>")
        except jinja2.exceptions.TemplateError as e:
            raise node.RequestError(f"the chat template refused the conversation: {e}", "prompt") from None

    def phase_build(self, batch: node.Batch) -> node.Batch:
        f = self.features
        prepared = []
        for e in batch:
            history = self._history(e)
            clips, heard = self._clips(self._audio(e), history)
            prepared.append((_text(e, "prompt"), _text(e, "system"), clips, heard, self._image(e), history))
        for prompt, _, _, heard, img, _ in prepared:
            if not prompt.strip() and not heard and img is None:
                raise node.RequestError("prompt is empty and there is no audio or image: nothing to answer", "prompt")
        texts = [self.render(self.messages(p, s, a, i is not None, h)) for p, s, _, a, i, h in prepared]
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        out: node.Batch = []
        for (_, _, clips, _, img, _), enc in zip(prepared, encodings, strict=True):
            # one mel per clip, joined along time; `clips` says where each ends (the encoder
            # encodes them apart, as transformers' audio tower does with feature_lens)
            mels = [log_mel(c, self.filters, f.n_fft, f.hop_length) for c in clips]
            mel = torch.cat(mels, dim=1) if mels else torch.zeros(f.feature_size, 0)
            frames = torch.tensor([m.shape[1] for m in mels], dtype=torch.int32)
            if img is not None:
                patches, grid = image_patches(img, f)
                pixels, grids = torch.from_numpy(patches), torch.tensor([grid], dtype=torch.int32)
            else:
                pixels = torch.zeros(0, 3 * f.temporal_patch_size * f.patch_size ** 2)
                grids = torch.zeros(0, 3, dtype=torch.int32)
            n_audio = [encoded_length(m.shape[1], self.n_window) for m in mels]
            n_image = int(grids[:, 0].mul(grids[:, 1]).mul(grids[:, 2]).sum()) // f.merge_size ** 2
            ids = self._expand(list(enc.ids), n_audio, n_image if img is not None else None)
            # host tensors: the thinker reads ids on the host anyway
            out.append({"ids": torch.tensor(ids, dtype=torch.int32), "mel": mel, "clips": frames, "pixels": pixels,
                        "grid": grids})
        return out

    def _expand(self, ids: list[int], n_audio: list[int], n_image: int | None) -> list[int]:
        """One id per audio / image token in place of each placeholder (the audio ones in the
        clips' order); the placeholders must be the template's."""
        counts = {self.ids.audio: ids.count(self.ids.audio), self.ids.image: ids.count(self.ids.image),
                  self.ids.video: ids.count(self.ids.video)}
        want = {self.ids.audio: len(n_audio), self.ids.image: int(n_image is not None),
                self.ids.video: 0}
        if counts != want:
            raise node.RequestError("the prompt contains an audio, image or video placeholder token; "
                                    "send media as the audio / image inputs", "prompt")
        out: list[int] = []
        clips = iter(n_audio)
        for t in ids:
            if t == self.ids.audio:
                out += [t] * next(clips)
            elif t == self.ids.image:
                out += [t] * int(n_image or 0)
            else:
                out.append(t)
        return out

    def _audio(self, entry: Mapping[str, Any]) -> torch.Tensor | None:
        a = entry.get("audio")
        if a is None or isinstance(a, torch.Tensor) and a.numel() == 0:
            return None
        if not isinstance(a, torch.Tensor) or not a.is_floating_point() or a.dim() != 1:
            got = f"{a.dtype} {list(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
            raise node.RequestError(f"audio must be float mono samples [A] at {self.features.sampling_rate} Hz, "
                                    f"got {got}", "audio")
        f = self.features
        if a.shape[0] <= f.n_fft // 2:  # the centred STFT reflects n_fft / 2 samples at each end
            raise node.RequestError(f"audio is {a.shape[0]} samples; at least {f.n_fft // 2 + 1} are needed", "audio")
        if a.shape[0] > f.max_audio_seconds * f.sampling_rate:
            raise node.RequestError(f"audio is {a.shape[0] / f.sampling_rate:.1f} s; at most {f.max_audio_seconds:g} s",
                                    "audio")
        a = a.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(a).all()):
            raise node.RequestError("audio holds NaN or infinite samples", "audio")
        return a

    def _image(self, entry: Mapping[str, Any]) -> np.ndarray | None:
        img = entry.get("image")
        if img is None or isinstance(img, torch.Tensor) and img.numel() == 0:
            return None
        if not isinstance(img, torch.Tensor) or img.dtype != torch.uint8 or img.dim() != 3 or img.shape[2] != 3:
            got = f"{img.dtype} {list(img.shape)}" if isinstance(img, torch.Tensor) else type(img).__name__
            raise node.RequestError(f"image must be u8 [H, W, 3] RGB, got {got}", "image")
        return img.detach().cpu().numpy()

    # ---- detokenize
    def phase_detokenize(self, batch: node.Batch) -> node.Batch:
        out: node.Batch = []
        for entry in batch:
            t = entry.get("token")
            if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dim() > 1:
                raise node.RequestError("token must be integer token ids [N]", "token")
            ids = [int(v) for v in t.reshape(-1).tolist()]
            if any(not 0 <= v < self.vocab for v in ids):
                raise node.RequestError(f"token ids must lie in [0, {self.vocab})", "token")
            if "token:context" not in entry:  # plain ids (the server renders a reply this way)
                out.append({"piece": self.tokenizer.decode(ids, skip_special_tokens=True)})
                continue
            context = entry["token:context"]
            if isinstance(context, bool) or not isinstance(context, int) or not 0 <= context <= len(ids):
                raise node.RequestError(f"token:context must be an int in [0, {len(ids)}], got {context!r}", "token")
            out.append({"piece": self._new_text(ids, context)})
        return out

    def _new_text(self, ids: list[int], context: int) -> str:
        """The text a stream chunk's new ids add: the characters whose last byte they hold.

        Byte-level BPE can split one character over several ids. The chunk's bytes go through
        an incremental UTF-8 decoder, its history first (output dropped), so a character
        waits for the id that completes it and the pieces of a stream join to one decode of
        all its ids (invalid bytes become U+FFFD, as the tokenizer's decode makes them). The
        history may start inside a character: those orphan bytes are in the dropped output,
        and 4 ids of history hold the 3 bytes a character can have before its last one."""
        if not isinstance(self.tokenizer.decoder, decoders.ByteLevel):  # not Qwen's shape: decode by ids
            before = self.tokenizer.decode(ids[:context], skip_special_tokens=True)
            return self.tokenizer.decode(ids, skip_special_tokens=True)[len(before):]
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        utf8.decode(b"".join(self._bytes(i) for i in ids[:context]))
        return utf8.decode(b"".join(self._bytes(i) for i in ids[context:]))

    def _bytes(self, token: int) -> bytes:
        """The bytes one id decodes to (special tokens: none; other added tokens: their text)."""
        if self._added_of is not self.tokenizer:
            self._added, self._added_of = self.tokenizer.get_added_tokens_decoder(), self.tokenizer
        added = self._added.get(token)
        if added is not None:
            return b"" if added.special else added.content.encode("utf-8")
        piece = self.tokenizer.id_to_token(token) or ""
        try:
            return bytes(BYTE_OF[c] for c in piece)
        except KeyError:  # not in the byte alphabet: the token's text itself
            return piece.encode("utf-8")


def _text(entry: Mapping[str, Any], port: str) -> str:
    value = entry.get(port, "")
    if not isinstance(value, str):
        raise node.RequestError(f"{port} must be a string, got {type(value).__name__}", port)
    return value

