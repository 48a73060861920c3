"""`GET /metrics`: Prometheus text exposition (format 0.0.4) of the server and its engine.

Two sources. Per-request figures (outcome, latency, time to first token / audio, real-time
factor, steps, preemptions, wasted speculative steps by walk) are observed by the server
when a request it served ends (`observe_flight`). Engine figures (queue depth, running
requests, KV pages, batch size, totals of steps, preemptions and wasted steps) are read
from `MStar.stats()` at scrape time, so they are exactly the engine's own counters.

Written by hand rather than with `prometheus_client`: a dozen series do not justify a
dependency, and all updates happen on the event loop thread (no locking needed).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mstar_runtime.outputs import is_audio_name

if TYPE_CHECKING:
    from mstar_runtime.serve.common import Flight

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)

Labels = tuple[tuple[str, str], ...]


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    esc = [(k, v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')) for k, v in labels]
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc) + "}"


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


@dataclass
class Family:
    name: str
    kind: str  # counter | gauge | histogram
    help: str
    buckets: tuple[float, ...] = ()
    values: dict[Labels, float] = field(default_factory=dict)
    hist: dict[Labels, list[float]] = field(default_factory=dict)  # bucket counts..., sum, count

    def inc(self, labels: Labels = (), by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by

    def set(self, labels: Labels, value: float) -> None:
        self.values[labels] = value

    def observe(self, labels: Labels, value: float) -> None:
        row = self.hist.setdefault(labels, [0.0] * (len(self.buckets) + 2))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                row[i] += 1
        row[-2] += value
        row[-1] += 1

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        if self.kind != "histogram":
            for labels, v in sorted(self.values.items()):
                yield f"{self.name}{_labels(labels)} {_num(v)}"
            return
        for labels, row in sorted(self.hist.items()):
            for bound, n in zip(self.buckets, row):
                yield f"{self.name}_bucket{_labels((*labels, ('le', _num(bound))))} {_num(n)}"
            yield f"{self.name}_bucket{_labels((*labels, ('le', '+Inf')))} {_num(row[-1])}"
            yield f"{self.name}_sum{_labels(labels)} {_num(row[-2])}"
            yield f"{self.name}_count{_labels(labels)} {_num(row[-1])}"


class Metrics:
    """Every series the server exports; `render(stats, server)` is the scrape."""

    def __init__(self) -> None:
        f = self._families = {}
        for name, kind, help_, buckets in (
            ("mstar_requests_total", "counter",
             "Requests by walk and outcome (finished, failed, cancelled, timeout, shutdown, rejected)", ()),
            ("mstar_http_responses_total", "counter", "HTTP responses by route and status code", ()),
            ("mstar_request_duration_seconds", "histogram", "Submit to end of a request, by walk",
             LATENCY_BUCKETS),
            ("mstar_time_to_first_output_seconds", "histogram",
             "Submit to the first output item of any kind (the engine's TTFT), by walk", LATENCY_BUCKETS),
            ("mstar_time_to_first_token_seconds", "histogram",
             "Submit to the first text token the server received, chat requests, by walk", LATENCY_BUCKETS),
            ("mstar_time_to_first_audio_seconds", "histogram",
             "Submit to the first audio chunk the server received, by walk", LATENCY_BUCKETS),
            ("mstar_real_time_factor", "histogram",
             "Generation seconds per second of audio produced (lower is faster), by walk", RTF_BUCKETS),
            ("mstar_audio_seconds_total", "counter", "Seconds of audio produced, by walk", ()),
            ("mstar_prompt_tokens_total", "counter", "Prompt tokens of chat requests, by walk", ()),
            ("mstar_completion_tokens_total", "counter", "Tokens streamed to chat clients, by walk", ()),
            ("mstar_request_steps_total", "counter", "Engine steps that served requests, by walk", ()),
            ("mstar_request_wasted_steps_total", "counter",
             "Speculative decode steps discarded, by walk (per-request stats)", ()),
            ("mstar_request_preemptions_total", "counter", "Preemptions of requests, by walk (per-request stats)",
             ()),
        ):
            f[name] = Family(name, kind, help_, buckets)
        self.sample_rate = 24000

    def __getitem__(self, name: str) -> Family:
        return self._families[name]

    def rejected(self, walk: str) -> None:
        self["mstar_requests_total"].inc((("walk", walk), ("outcome", "rejected")))

    def response(self, route: str, status: int) -> None:
        self["mstar_http_responses_total"].inc((("route", route), ("code", str(status))))

    def observe_flight(self, flight: Flight, outcome: str) -> None:
        w = (("walk", flight.walk),)
        self["mstar_requests_total"].inc((*w, ("outcome", outcome)))
        st = flight.handle.stats
        self["mstar_request_steps_total"].inc(w, st.get("steps") or 0)
        self["mstar_request_wasted_steps_total"].inc(w, st.get("wasted_steps") or 0)
        self["mstar_request_preemptions_total"].inc(w, st.get("preemptions") or 0)
        if outcome != "finished":
            return  # latencies of requests that did not finish would only blur the histograms
        if st.get("total_s") is not None:
            self["mstar_request_duration_seconds"].observe(w, st["total_s"])
        if st.get("ttft_s") is not None:
            self["mstar_time_to_first_output_seconds"].observe(w, st["ttft_s"])
        if flight.route == "chat" and flight.first_at:
            self["mstar_time_to_first_token_seconds"].observe(w, min(flight.first_at.values()))
            self["mstar_prompt_tokens_total"].inc(w, flight.prompt_tokens)
            self["mstar_completion_tokens_total"].inc(w, flight.tokens)
        audio_first = [t for name, t in flight.first_at.items() if is_audio_name(name)]
        if audio_first:
            self["mstar_time_to_first_audio_seconds"].observe(w, min(audio_first))
        if flight.audio_samples and st.get("total_s") is not None:
            seconds = flight.audio_samples / self.sample_rate
            self["mstar_audio_seconds_total"].inc(w, seconds)
            self["mstar_real_time_factor"].observe(w, st["total_s"] / seconds)

    def render(self, stats: Mapping[str, Any], server: Mapping[str, float]) -> str:
        lines: list[str] = []
        for fam in self._families.values():
            lines.extend(fam.render())
        lines.extend(_engine_lines(stats, server))
        return "\n".join(lines) + "\n"


# name, type, help, key in MStar.stats() (None: in `server`)
_ENGINE: tuple[tuple[str, str, str, str], ...] = (
    ("mstar_queue_depth", "gauge", "Requests waiting for admission to the engine", "waiting"),
    ("mstar_requests_running", "gauge", "Requests admitted and running in the engine", "running"),
    ("mstar_kv_pages_in_use", "gauge", "KV cache pages held by requests (all pools)", "kv_used_pages"),
    ("mstar_kv_pages_total", "gauge", "KV cache pages of all pools", "kv_total_pages"),
    ("mstar_engine_mean_batch_size", "gauge", "Mean entries per engine step since start", "mean_batch"),
    ("mstar_engine_steps_total", "counter", "Batched engine steps run", "steps"),
    ("mstar_engine_batched_entries_total", "counter", "Request entries run in engine steps", "batched_entries"),
    ("mstar_engine_step_seconds_total", "counter", "Host seconds spent in engine steps", "step_seconds"),
    ("mstar_preemptions_total", "counter", "Requests preempted to free KV pages (engine total)", "preemptions"),
    ("mstar_wasted_speculative_steps_total", "counter",
     "Speculative dynamic-loop steps discarded (engine total)", "wasted_steps"),
    ("mstar_engine_remote_steps_total", "counter", "Steps sent to worker processes without waiting", "remote_steps"),
    ("mstar_engine_overlapped_steps_total", "counter",
     "Engine steps started while a remote step was in flight", "overlapped_steps"),
    ("mstar_engine_remote_wait_seconds_total", "counter",
     "Seconds the engine waited for a remote step with nothing else to run", "remote_wait_seconds"),
)
_SERVER: tuple[tuple[str, str, str], ...] = (
    ("mstar_requests_active", "gauge", "Requests submitted to the engine and not yet ended"),
    ("mstar_server_inflight", "gauge", "HTTP requests being served by a walk"),
    ("mstar_server_draining", "gauge", "1 while the server drains after SIGTERM"),
    ("mstar_engine_healthy", "gauge", "1 while the engine and its workers serve"),
)


def _engine_lines(stats: Mapping[str, Any], server: Mapping[str, float]) -> Iterable[str]:
    for name, kind, help_, key in _ENGINE:
        value = stats.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield from (f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {_num(value)}")
    counts = stats.get("requests", {})
    yield "# HELP mstar_engine_requests_total Requests by the engine's own count (submitted and by end state)"
    yield "# TYPE mstar_engine_requests_total counter"
    for state, n in sorted(counts.items()):
        if state != "active":
            yield f"mstar_engine_requests_total{_labels((('state', state),))} {_num(n)}"
    for name, kind, help_ in _SERVER:
        if name in server:
            yield from (f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {_num(server[name])}")


__all__ = ["Metrics"]
