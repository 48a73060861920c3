"""A request's sampling settings, and the one place that reads them from a node's input ports.

`SamplingParams` checks its values (a bad one is a `RequestError` naming the field);
`read_sampling(entry, ports)` reads `temperature`, `top_k`, `top_p`, `repetition_penalty`,
`seed`, a `do_sample` flag and the node's token limit (`max_tokens`, or the name its walk
gives it) from a batch entry, as the node's `SamplingPorts` declares them: a port the node
does not read keeps the setting off, a port with a default may be absent, any other is
required; a model's own fixed top-k (`SamplingPorts.fixed_top_k`) applies to a sampled
request. A request without a seed gets a fresh random one here, once, so that all of its
draws come from one seed (`seeds.uniform(seed, step)`): its tokens do not depend on its batch
or its timing. Nodes of one request that share its seed draw from their own streams of it
(`SamplingParams.stream`, `seeds.derive_seed`).

Every node that samples reads its settings here: Orpheus' backbone, Qwen3-Omni's thinker and
talker (models/mstar_models/qwen3_omni/lm_common.py), Whisper's decoder, BAGEL's MoT.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar_runtime.ops.node import RequestError
from mstar_runtime.ops.ports import scalar
from mstar_runtime.sampling.seeds import derive_seed


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One request's sampling settings; invalid values raise a `RequestError` naming the field."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    seed: int | None = None
    max_tokens: int | None = None  # tokens (or frames) the request may generate; None: the node's limit only

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise RequestError(
                f"temperature must be a finite number >= 0, got {self.temperature}", "temperature"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}", "top_k")
        if not (0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise RequestError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise RequestError(f"seed must be an integer, got {self.seed!r}", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self) -> SamplingParams:
        """These params with a fresh random seed if they have none (call once, at admission)."""
        return self if self.seed is not None else dataclasses.replace(self, seed=secrets.randbits(63))

    def stream(self, stream: int) -> SamplingParams:
        """These params drawing from stream `stream` of their seed (`derive_seed`, 64 bits): the
        nodes of one request that share its seed each draw from their own stream, so that their
        draws at the same step are unrelated. A missing seed gets a fresh one first."""
        seeded = self.with_seed()
        return dataclasses.replace(seeded, seed=derive_seed(seeded.seed, stream))


_OFF = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}  # SamplingParams' defaults
REQUIRED: Any = object()  # a `SamplingPorts` default: the port must be given


@dataclass(frozen=True)
class SamplingPorts:
    """Which sampling ports a node reads, with their defaults (`REQUIRED`: no default; None:
    the node has no such port and the setting stays off). `limit` names the token-limit port
    (required, an integer >= 1; None: the node has none); `do_sample`, when set, names a bool
    port (default True) whose False makes the request greedy whatever its temperature.
    `fixed_top_k` is a top-k the model applies itself (no port): a sampled request gets it, a
    greedy one (temperature 0) keeps top-k off; a node with one has no `top_k` port."""

    temperature: Any = REQUIRED
    top_k: Any = None
    top_p: Any = None
    repetition_penalty: Any = None
    limit: str | None = "max_tokens"
    do_sample: str | None = None
    finite: bool = False  # refuse an infinite temperature as a malformed port, before the params check
    fixed_top_k: int | None = None

    def __post_init__(self) -> None:
        if self.fixed_top_k is not None and self.top_k is not None:
            raise ValueError("a node with a fixed_top_k has no top_k port")


def read_sampling(entry: Mapping[str, Any], ports: SamplingPorts) -> SamplingParams:
    """The request's `SamplingParams` from its batch entry (RequestError naming a bad port).

    The ports are read in this order (the first bad one is the error): `do_sample`, the limit,
    `temperature`, `top_k`, `top_p`, `repetition_penalty`, `seed`; then `SamplingParams`
    checks the values. A port given as None is missing, default or not."""

    def port(name: str, kind: type, default: Any) -> Any:
        if default is None:
            return _OFF[name]
        return scalar(entry, name, kind, None if default is REQUIRED else default,
                      finite=ports.finite and kind is float, required=True)

    greedy = ports.do_sample is not None and not scalar(entry, ports.do_sample, bool, True, required=True)
    limit = None
    if ports.limit is not None:
        limit = scalar(entry, ports.limit, int, required=True)
        if limit < 1:
            raise RequestError(f"{ports.limit} must be >= 1, got {limit}", ports.limit)
    temperature = 0.0 if greedy else port("temperature", float, ports.temperature)
    top_k = port("top_k", int, ports.top_k)
    if ports.fixed_top_k is not None and temperature > 0:
        top_k = ports.fixed_top_k
    seed = entry.get("seed")
    return SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=port("top_p", float, ports.top_p),
        repetition_penalty=port("repetition_penalty", float, ports.repetition_penalty),
        seed=None if seed is None else scalar(entry, "seed", int),
        max_tokens=limit,
    ).with_seed()
