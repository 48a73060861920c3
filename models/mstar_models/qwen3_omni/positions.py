"""Qwen3-Omni's rotary positions: the 3-D (t, h, w) position rules of the thinker and talker, and the RoPE tables.

`rope_index` gives every prompt position its (t, h, w) position by the rules of transformers
5.24's `Qwen3OmniMoePreTrainedModelForConditionalGeneration.get_rope_index`:

- a prompt without image or video grids is 1-D: position i in all three components, delta 0
  (audio alone keeps 1-D positions, as there);
- otherwise text runs and the start/end markers of each segment are sequential, continuing
  from the largest position used so far plus one; audio placeholders are sequential; an
  image's merged patches get (t * position_id_per_seconds, row, column) offset by the segment
  start, t over the image's temporal patches; a video's t is scaled by its seconds per
  temporal patch; with `use_audio_in_video`, a video's patches and its audio placeholders
  (two start and two end markers) are interleaved by time, video first on ties: the
  audio/video time alignment;
- `delta` = largest position + 1 - prompt length; decode step positions are the KV index
  plus delta, in all three components.

Positions are float32, as there (a video's seconds per patch may be fractional). Each
audio's token count is the number of its placeholders (the processor writes as many as the
encoder gives, `_get_feat_extract_output_lengths` there), unless `audio_lengths` says.

`mstar_models.layers.rotary.mrope_tables` turns these (t, h, w) positions into cos/sin with
interleaved MRoPE (its `rope_tables` is the 1-D form the code predictor uses).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar_models.qwen3_omni.tokens import TokenIds
from mstar_runtime.ops import node

Grid = Sequence[int]  # (t, h, w) in patches, before the spatial merge


def default_mrope_section(head_dim: int) -> list[int]:
    """(t, h, w) frequency sections: the released [24, 20, 20] at head_dim 128, scaled the same
    way for other sizes (h = w = 5/16 of the head_dim / 2 slots, t the rest: [4, 2, 2] at 16)."""
    half = head_dim // 2
    hw = half * 5 // 16
    return [half - 2 * hw, hw, hw]


def _vision(start: torch.Tensor, t_index: torch.Tensor, grid: Grid, merge: int) -> torch.Tensor:
    """(t, h, w) of one image's or video's merged patches, in row-major order per temporal patch."""
    h, w = int(grid[1]) // merge, int(grid[2]) // merge
    n_t = t_index.numel()
    t = t_index.view(-1, 1).expand(-1, h * w).flatten().float()
    rows = torch.arange(h).view(1, -1, 1).expand(n_t, -1, w).flatten().float()
    cols = torch.arange(w).view(1, 1, -1).expand(n_t, h, -1).flatten().float()
    return torch.stack([t, rows, cols]) + start


def _seq(n: int | torch.Tensor, start: torch.Tensor | int) -> torch.Tensor:
    return torch.arange(int(n)).view(1, -1).expand(3, -1) + start


def _count_until(ids: list[int], at: int, token: int, end: int) -> int:
    """Occurrences of `token` after index `at` up to the next `end` marker (an audio's placeholders)."""
    n = 0
    for t in ids[at + 1 :]:
        if t == end:
            break
        n += t == token
    return n


def rope_index(
    ids: Sequence[int],
    tok: TokenIds,
    image_grids: Sequence[Grid] = (),
    video_grids: Sequence[Grid] = (),
    video_seconds: Sequence[float] = (),
    audio_lengths: Sequence[int] | None = None,
    use_audio_in_video: bool = False,
) -> tuple[torch.Tensor, float]:
    """(positions float32 [3, T], delta) of one prompt; see the module docstring."""
    ids = [int(t) for t in ids]
    n = len(ids)
    if not image_grids and not video_grids:
        return torch.arange(n, dtype=torch.float32).view(1, -1).expand(3, -1).clone(), 0.0
    merge, pps = tok.vis_merge, tok.position_id_per_seconds
    starts = [i for i, t in enumerate(ids) if t == tok.vision_start_token_id]
    after = [ids[i + 1] if i + 1 < n else -1 for i in starts]
    n_audio = ids.count(tok.audio_start_token_id)
    n_image = after.count(tok.image_token_id)
    n_video = after.count(tok.audio_start_token_id if use_audio_in_video else tok.video_token_id)
    if n_image != len(image_grids) or n_video != len(video_grids):
        raise node.RequestError(
            f"the prompt has {n_image} image(s) and {n_video} video(s) but {len(image_grids)} image and "
            f"{len(video_grids)} video grid(s)", "grid"
        )
    if n_video and len(video_seconds) != n_video:
        raise node.RequestError(f"{n_video} video(s) need as many seconds-per-patch values", "video_seconds")
    has_vision = tok.image_token_id in ids or tok.video_token_id in ids
    has_audio = tok.audio_token_id in ids
    left = {"image": n_image, "video": n_video, "audio": n_audio}
    at = {"image": 0, "video": 0, "audio": 0}
    pieces: list[torch.Tensor] = []
    st = 0

    def next_start() -> torch.Tensor | int:
        return pieces[-1].max() + 1 if pieces else 0

    def audio_len(marker: int) -> int:
        if audio_lengths is not None:
            if at["audio"] >= len(audio_lengths):
                raise node.RequestError(f"more audio segments than the {len(audio_lengths)} audio length(s)", "audio")
            return int(audio_lengths[at["audio"]])
        return _count_until(ids, marker, tok.audio_token_id, tok.audio_end_token_id)

    for _ in range(n_image + n_audio if use_audio_in_video else n_image + n_video + n_audio):
        start = next_start()
        vis = (
            ids.index(tok.vision_start_token_id, st)
            if has_vision and (left["video"] > 0 or left["image"] > 0) and tok.vision_start_token_id in ids[st:]
            else n + 1
        )
        aud = (
            ids.index(tok.audio_start_token_id, st)
            if has_audio and left["audio"] > 0 and tok.audio_start_token_id in ids[st:]
            else n + 1
        )
        first = min(vis, aud)
        if first > n:
            raise node.RequestError("a multimodal segment has no start marker where its placeholders are", "ids")
        text = first - st
        if text:
            pieces.append(_seq(text, start))
            start = start + text
        both = first == vis and vis + 1 == aud  # a video with its audio track: two markers each side
        marks = 2 if both else 1
        pieces.append(_seq(marks, start))
        start = start + marks
        if first == aud:
            length = audio_len(aud)
            pieces.append(_seq(length, start))
            st += text + marks + length + marks
            at["audio"] += 1
            left["audio"] -= 1
        elif ids[vis + 1] == tok.image_token_id:
            grid = image_grids[at["image"]]
            t_index = (torch.arange(int(grid[0])) * 1 * pps).float()
            pieces.append(_vision(start, t_index, grid, merge))
            st += text + marks + int(grid[0]) * int(grid[1]) * int(grid[2]) // merge**2 + marks
            at["image"] += 1
            left["image"] -= 1
        elif ids[vis + 1] == tok.video_token_id:
            grid = video_grids[at["video"]]
            sec = torch.tensor(float(video_seconds[at["video"]]), dtype=torch.float32)
            pieces.append(_vision(start, (torch.arange(int(grid[0])) * sec * pps).float(), grid, merge))
            st += text + marks + int(grid[0]) * int(grid[1]) * int(grid[2]) // merge**2 + marks
            at["video"] += 1
            left["video"] -= 1
        elif both:
            length = audio_len(aud)
            audio = _seq(length, start)
            grid = video_grids[at["video"]]
            sec = torch.tensor(float(video_seconds[at["video"]]), dtype=torch.float32)
            video = _vision(start, (torch.arange(int(grid[0])) * sec * pps).float(), grid, merge)
            pieces.extend(_interleave(video, audio))
            st += text + marks + length + int(grid[0]) * int(grid[1]) * int(grid[2]) // merge**2 + marks
            at["audio"] += 1
            at["video"] += 1
            left["audio"] -= 1
            left["video"] -= 1
        else:
            raise node.RequestError(f"vision start at {vis} is followed by neither an image nor a video", "ids")
        pieces.append(_seq(marks, next_start()))
    if st < n:
        pieces.append(_seq(n - st, next_start()))
    positions = torch.cat([p.float() for p in pieces], dim=1)
    if positions.shape[1] != n:
        raise node.RequestError(
            f"the prompt's placeholders do not match its grids / audio lengths ({positions.shape[1]} "
            f"positions for {n} tokens)", "ids"
        )
    return positions, float(positions.max() + 1 - n)


def _interleave(video: torch.Tensor, audio: torch.Tensor) -> list[torch.Tensor]:
    """Video patches and audio tokens merged by their t component, a video patch first on ties."""
    out: list[torch.Tensor] = []
    i = j = 0
    nv, na = video.shape[1], audio.shape[1]
    while i < nv and j < na:
        if video[0, i] <= audio[0, j]:
            out.append(video[:, i : i + 1])
            i += 1
        else:
            out.append(audio[:, j : j + 1])
            j += 1
    if i < nv:
        out.append(video[:, i:])
    if j < na:
        out.append(audio[:, j:])
    return out
