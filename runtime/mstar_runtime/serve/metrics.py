"""`GET /metrics`: the server's and its engine's series through `prometheus_client`.

Every M* series carries a `model_name` label (the served model id, as vLLM's do), so one
Prometheus can scrape several servers and a dashboard can filter by model. Three sources:

- per request, observed by the server when a request it served ends (`observe_flight`):
  outcome, latency, time to first output / token / audio, inter-token latency (per streamed
  item: an item may hold several tokens the engine emitted together) and time per output
  token, real-time factor, steps, preemptions and wasted speculative steps, by walk;
- the engine, read from `MStar.stats()` at scrape time (`_EngineCollector`), so they are
  exactly the engine's own counters: queue depth, running requests, KV pages and their
  0-1 usage, batch size, totals of steps, preemptions and wasted steps, the prefix cache's
  queries, hits (tokens), hit rate, cached blocks and evictions;
- the process: CPU seconds, resident memory, open file descriptors (`process_*`), Python's
  garbage collector (`python_gc_*`) and version (`python_info`), prometheus_client's own
  collectors. A multi-rank plan's worker processes are not among them.

Each server has its own `CollectorRegistry` (several apps in one process, as tests make,
do not collide). `render(accept)` picks the exposition format from the scraper's Accept
header: Prometheus text 0.0.4 by default, OpenMetrics when asked. docs/serving.md maps the
series to vLLM's names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from mstar_runtime.api import RequestHandle
from mstar_runtime.outputs import is_audio_name

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# inter-token gaps of a decode loop: a few ms per step on a GPU, tens on a busy CPU
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)

MODEL = "model_name"


class Observed(Protocol):
    """What `Metrics.observe_flight` reads of a request the server served (a `serve.flight.Flight`,
    which is built on the state that holds these metrics, so it is named here by what it has)."""

    walk: str
    route: str
    handle: RequestHandle  # its `stats`
    t0: float  # perf_counter at submit
    first_at: dict[str, float]  # output name -> seconds from submit to its first item
    token_gaps: list[float]
    first_token_s: float | None
    last_token_s: float | None
    tokens: int
    prompt_tokens: int
    audio_samples: int

# name, type, help, key in MStar.stats(): read at scrape time
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
    ("mstar_prefix_cache_queries_total", "counter",
     "Prompt tokens looked up in the prefix cache (prefills of nodes that give content keys)", "prefix_query_tokens"),
    ("mstar_prefix_cache_hits_total", "counter",
     "Of those, tokens whose KV was found cached and not computed", "prefix_hit_tokens"),
    ("mstar_prefix_cache_blocks", "gauge",
     "KV pages that hold a cached block, held by a request or not (all pools)", "prefix_cached_pages"),
    ("mstar_prefix_cache_evictions_total", "counter",
     "Cached blocks evicted to make room (least recently used first)", "prefix_evictions"),
)
# name, help: the server's own gauges, from `ServerState.server_gauges` at scrape time
_SERVER: tuple[tuple[str, str], ...] = (
    ("mstar_requests_active", "Requests submitted to the engine and not yet ended"),
    ("mstar_server_inflight", "HTTP requests being served by a walk"),
    ("mstar_server_draining", "1 while the server drains after SIGTERM"),
    ("mstar_realtime_sessions", "Open /v1/realtime sessions (WebSockets)"),
    ("mstar_engine_healthy", "1 while the engine and its workers serve"),
)

Snapshot = Callable[[], tuple[Mapping[str, Any], Mapping[str, float]]]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def hit_rate(stats: Mapping[str, Any]) -> float:
    """Prefix-cache hit tokens over looked-up tokens since start, 0 to 1 (0 before any look-up)."""
    hits, queries = _number(stats.get("prefix_hit_tokens")), _number(stats.get("prefix_query_tokens"))
    if hits is None or not queries:
        return 0.0
    return min(1.0, max(0.0, hits / queries))


def kv_usage(stats: Mapping[str, Any]) -> float:
    """The fraction of KV pages in use, 0 to 1 (0 for a plan without a KV pool)."""
    used, total = _number(stats.get("kv_used_pages")), _number(stats.get("kv_total_pages"))
    if used is None or not total:
        return 0.0
    return min(1.0, max(0.0, used / total))


class _EngineCollector:
    """The engine's and the server's figures of this moment, as metric families. A
    prometheus_client collector: the registry calls `collect` on every scrape."""

    def __init__(self, model: str, snapshot: Snapshot):
        self.model, self.snapshot = model, snapshot

    def describe(self) -> list[Any]:
        return []  # the names depend on what `stats()` holds; none clash with the fixed series

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats, server = self.snapshot()
        kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
        for name, kind, help_, key in _ENGINE:
            value = _number(stats.get(key))
            if value is not None:
                family = kinds[kind](name, help_, labels=[MODEL])
                family.add_metric([self.model], value)
                yield family
        usage = GaugeMetricFamily("mstar_kv_cache_usage_perc",
                                  "Fraction of KV cache pages in use, 0 to 1 (all pools)", labels=[MODEL])
        usage.add_metric([self.model], kv_usage(stats))
        yield usage
        rate = GaugeMetricFamily("mstar_prefix_cache_hit_rate",
                                 "Prefix-cache hits over queries since start, in tokens, 0 to 1", labels=[MODEL])
        rate.add_metric([self.model], hit_rate(stats))
        yield rate
        counts = CounterMetricFamily("mstar_engine_requests_total",
                                     "Requests by the engine's own count (submitted and by end state)",
                                     labels=[MODEL, "state"])
        for state, n in sorted((stats.get("requests") or {}).items()):
            if state != "active" and _number(n) is not None:
                counts.add_metric([self.model, str(state)], float(n))
        yield counts
        for name, help_ in _SERVER:
            if name in server:
                family = GaugeMetricFamily(name, help_, labels=[MODEL])
                family.add_metric([self.model], float(server[name]))
                yield family


class Metrics:
    """Every series the server exports (see the module docstring); `render` is the scrape.

    `snapshot` returns `(MStar.stats(), server gauges)` at scrape time; without one the
    engine series are absent (a `Metrics` built before its server)."""

    def __init__(self, model_name: str = "", sample_rate: int = 24000, snapshot: Snapshot | None = None):
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            GCCollector,
            Histogram,
            PlatformCollector,
            ProcessCollector,
            disable_created_metrics,
        )

        # `_created` samples double every counter's and histogram's lines and no dashboard reads them
        disable_created_metrics()
        self.model_name, self.sample_rate = model_name, sample_rate
        self.registry = reg = CollectorRegistry(auto_describe=False)
        by_walk = (MODEL, "walk")

        def counter(name: str, help_: str, labels: tuple[str, ...] = by_walk) -> Any:
            return Counter(name, help_, labels, registry=reg)

        def histogram(name: str, help_: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, help_, by_walk, registry=reg, buckets=buckets)

        self.requests = counter("mstar_requests_total",
                                "Requests by walk and outcome (finished, failed, cancelled, timeout, shutdown, "
                                "rejected)", (MODEL, "walk", "outcome"))
        self.responses = counter("mstar_http_responses_total", "HTTP responses by route and status code",
                                 (MODEL, "route", "code"))
        self.duration = histogram("mstar_request_duration_seconds", "Submit to end of a request, by walk",
                                  LATENCY_BUCKETS)
        self.ttfo = histogram("mstar_time_to_first_output_seconds",
                              "Submit to the first output item of any kind (the engine's TTFT), by walk",
                              LATENCY_BUCKETS)
        self.ttft = histogram("mstar_time_to_first_token_seconds",
                              "Submit to the first text token the server received, chat requests, by walk",
                              LATENCY_BUCKETS)
        self.ttfa = histogram("mstar_time_to_first_audio_seconds",
                              "Submit to the first audio chunk the server received, by walk", LATENCY_BUCKETS)
        self.itl = histogram("mstar_inter_token_latency_seconds",
                             "Time between consecutive streamed items of a token or text output, by walk",
                             ITL_BUCKETS)
        self.tpot = histogram("mstar_request_time_per_output_token_seconds",
                              "Chat: first to last token received, per token after the first, by walk", ITL_BUCKETS)
        self.rtf = histogram("mstar_real_time_factor",
                             "Generation seconds per second of audio produced (lower is faster), by walk",
                             RTF_BUCKETS)
        self.audio_seconds = counter("mstar_audio_seconds_total", "Seconds of audio produced, by walk")
        self.prompt_tokens = counter("mstar_prompt_tokens_total", "Prompt tokens of chat requests, by walk")
        self.completion_tokens = counter("mstar_completion_tokens_total", "Tokens streamed to chat clients, by walk")
        self.steps = counter("mstar_request_steps_total", "Engine steps that served requests, by walk")
        self.wasted = counter("mstar_request_wasted_steps_total",
                              "Speculative decode steps discarded, by walk (per-request stats)")
        self.preemptions = counter("mstar_request_preemptions_total",
                                   "Preemptions of requests, by walk (per-request stats)")
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        if snapshot is not None:
            reg.register(_EngineCollector(model_name, snapshot))

    def rejected(self, walk: str) -> None:
        self.requests.labels(self.model_name, walk, "rejected").inc()

    def response(self, route: str, status: int) -> None:
        self.responses.labels(self.model_name, route, str(status)).inc()

    def observe_flight(self, flight: Observed, outcome: str) -> None:
        m, w = self.model_name, flight.walk
        self.requests.labels(m, w, outcome).inc()
        st = flight.handle.stats
        self.steps.labels(m, w).inc(st.get("steps") or 0)
        self.wasted.labels(m, w).inc(st.get("wasted_steps") or 0)
        self.preemptions.labels(m, w).inc(st.get("preemptions") or 0)
        if outcome != "finished":
            return  # latencies of requests that did not finish would only blur the histograms
        # A route that ended the request on purpose (a reply cut at max_tokens) has cancelled
        # the rest of the walk, which the engine has not ended yet: the request ends now.
        total = st["total_s"] if st.get("total_s") is not None else time.perf_counter() - flight.t0
        self.duration.labels(m, w).observe(total)
        if st.get("ttft_s") is not None:
            self.ttfo.labels(m, w).observe(st["ttft_s"])
        if flight.route == "chat" and flight.first_at:
            self.ttft.labels(m, w).observe(min(flight.first_at.values()))
            self.prompt_tokens.labels(m, w).inc(flight.prompt_tokens)
            self.completion_tokens.labels(m, w).inc(flight.tokens)
        if flight.token_gaps:
            itl = self.itl.labels(m, w)
            for gap in flight.token_gaps:
                itl.observe(gap)
        first, last = flight.first_token_s, flight.last_token_s
        if flight.route == "chat" and flight.tokens > 1 and first is not None and last is not None:
            self.tpot.labels(m, w).observe((last - first) / (flight.tokens - 1))
        audio_first = [t for name, t in flight.first_at.items() if is_audio_name(name)]
        if audio_first:
            self.ttfa.labels(m, w).observe(min(audio_first))
        if flight.audio_samples:
            seconds = flight.audio_samples / self.sample_rate
            self.audio_seconds.labels(m, w).inc(seconds)
            self.rtf.labels(m, w).observe(total / seconds)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """(body, Content-Type) of one scrape, in the format the Accept header asks for."""
        from prometheus_client.exposition import choose_encoder

        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type


__all__ = ["ITL_BUCKETS", "LATENCY_BUCKETS", "RTF_BUCKETS", "Metrics", "Observed", "hit_rate", "kv_usage"]
