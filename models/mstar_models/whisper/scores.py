"""Whisper's token rules: the scores a decoder step picks its token from (`whisper_scores`).

transformers' `WhisperForConditionalGeneration.generate` for one window, as its generation
config sets it up, applied in its order: `<|endoftext|>` held back below `min_new_tokens`,
the begin suppressions (`begin_suppress_tokens` at the first generated token),
`suppress_tokens` always, and with timestamps the timestamp rules of
`WhisperTimeStampLogitsProcessor` (no `<|notimestamps|>`; timestamps in pairs; never
decreasing; the first token a timestamp of at most `max_initial_timestamp` steps; a timestamp
whenever the timestamps' total probability beats every text token's). The decoder's prefill
(its first token) and its column step (every later one) both score through it (decoder.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mstar_models.whisper.tokens import Layout
from mstar_runtime.ops import node

NEG_INF = float("-inf")


class Rules:
    """The generation config's token rules as device masks; `whisper_scores` applies them."""

    def __init__(self, layout: Layout, suppress: Sequence[int], begin_suppress: Sequence[int],
                 max_initial_timestamp: int | None, device: torch.device):
        self.layout = layout
        v = layout.vocab
        for t in (*suppress, *begin_suppress):
            if not 0 <= t < v:
                raise node.NodeError(f"suppressed token {t} is outside the vocabulary of {v}")
        self.suppress = torch.zeros(v, dtype=torch.bool, device=device)
        self.suppress[list(suppress)] = True
        self.begin = torch.zeros(v, dtype=torch.bool, device=device)
        self.begin[list(begin_suppress)] = True
        self.max_initial = max_initial_timestamp
        self.vocab_ids = torch.arange(v, device=device)
        self.languages = torch.ones(v, dtype=torch.bool, device=device)
        self.languages[layout.first_language : layout.first_language + layout.languages] = False


def whisper_scores(logits: torch.Tensor, rules: Rules, n: torch.Tensor, last: torch.Tensor, penult: torch.Tensor,
                   ts_max: torch.Tensor, timestamps: torch.Tensor, min_new: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 logits [B, V] -> the scores greedy decoding takes the argmax of (see the module
    docstring). Per row: `n` tokens generated so far, the `last` and `penult` of them (any value
    when there are fewer), the highest timestamp `ts_max` (-1: none), `timestamps` on or off,
    and `min_new`, the tokens before which `<|endoftext|>` is suppressed (transformers'
    `MinNewTokensLengthLogitsProcessor`, which runs before the others). Pure tensor code (no
    host read, no per-row Python)."""
    lay = rules.layout
    tb, ids = lay.timestamp_begin, rules.vocab_ids[None, :]
    first = (n == 0)[:, None]
    s = logits
    if min_new is not None:
        s = s.masked_fill((n < min_new)[:, None] & (ids == lay.eot), NEG_INF)
    s = s.masked_fill(first & rules.begin[None, :], NEG_INF)
    s = s.masked_fill(rules.suppress[None, :], NEG_INF)
    # the timestamp rules, for the rows that want timestamps
    t = s.clone()
    t[:, lay.notimestamps] = NEG_INF
    last_ts = ((n >= 1) & (last >= tb))[:, None]
    pen_ts = ((n < 2) | (penult >= tb))[:, None]
    is_ts = ids >= tb
    t = t.masked_fill(last_ts & pen_ts & is_ts, NEG_INF)  # a pair just closed: text (or eot) next
    t = t.masked_fill(last_ts & ~pen_ts & (ids < lay.eot), NEG_INF)  # an open timestamp: no text
    # never below the last timestamp (nor equal to it, unless it closes the pair it opened)
    floor = torch.where(ts_max < 0, torch.full_like(ts_max, tb),
                        torch.where((last_ts & ~pen_ts)[:, 0], ts_max, ts_max + 1))
    t = t.masked_fill(is_ts & (ids < floor[:, None]), NEG_INF)
    t = t.masked_fill(first & ~is_ts, NEG_INF)  # the first token is a timestamp ...
    if rules.max_initial is not None:  # ... of at most max_initial_timestamp steps
        t = t.masked_fill(first & (ids > tb + rules.max_initial), NEG_INF)
    logprobs = F.log_softmax(t.float(), dim=-1)
    ts_mass = logprobs[:, tb:].logsumexp(dim=-1)
    best_text = logprobs[:, :tb].max(dim=-1).values
    t = t.masked_fill((ts_mass > best_text)[:, None] & ~is_ts, NEG_INF)
    return torch.where(timestamps[:, None], t, s)
