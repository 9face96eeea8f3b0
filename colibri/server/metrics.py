"""/metrics: the Prometheus text of one server, through prometheus-client.

Counted by the routes: colibri_requests_total{route, status}, colibri_prompt_tokens_total,
colibri_completion_tokens_total. Read from the engine at each scrape: colibri_tokens_per_second
(generated tokens over the last 10 s), colibri_queue_depth, colibri_slots_busy,
colibri_slots_total, colibri_kv_bytes_in_use, colibri_kv_bytes_budget, colibri_rss_bytes (this
process), colibri_model_info{version, path}, colibri_reloads_total,
colibri_reload_failures_total, the prefix cache's (colibri.engine.prefix_cache) of the version
serving: colibri_prefix_cache_hits_total / _misses_total (prompt tokens copied from it /
computed), colibri_prefix_cache_lookups_total (prompts), colibri_prefix_cache_evictions_total
(blocks), colibri_prefix_cache_bytes, colibri_prefix_cache_capacity_bytes,
colibri_prefix_cache_blocks (a reload starts them again at 0); with serve --draft
colibri_draft_tokens_total and colibri_draft_accepted_tokens_total; with serve
--expert-shards, per shard (label shard): colibri_expert_shard_calls_total, _slots_total,
_seconds_total, _failures_total and colibri_expert_shard_experts. Each app has its own
registry (several apps can live in one
process, as in the tests and under Ray Serve).
"""
from __future__ import annotations

import time
from collections import deque

import psutil
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .engine import ModelHolder

__all__ = ["Metrics", "TokenRate", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class TokenRate:
    """Generated tokens per second over a sliding window (seconds)."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self._times: deque[float] = deque()

    def add(self, n: int = 1) -> None:
        now = time.monotonic()
        self._times.extend([now] * n)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._times and self._times[0] < now - self.window:
            self._times.popleft()

    def per_second(self) -> float:
        self._trim(time.monotonic())
        return len(self._times) / self.window


class _EngineCollector:
    """The gauges read from the holder's current engine at each scrape."""

    def __init__(self, holder: ModelHolder, rate: TokenRate):
        self.holder, self.rate = holder, rate
        self.process = psutil.Process()

    def collect(self):
        engine = self.holder.current
        s = engine.scheduler.stats()

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            return g

        yield gauge("colibri_tokens_per_second", "generated tokens per second over the last "
                    f"{self.rate.window:g} s", self.rate.per_second())
        yield gauge("colibri_queue_depth", "requests waiting for a slot", s["queue_depth"])
        yield gauge("colibri_slots_busy", "slots running a request", s["slots_busy"])
        yield gauge("colibri_slots_total", "slots (--parallel)", s["slots_total"])
        yield gauge("colibri_kv_bytes_in_use", "KV cache bytes reserved by admitted requests",
                    s["kv_bytes_in_use"])
        yield gauge("colibri_kv_bytes_budget", "KV cache bytes all requests may hold",
                    s["kv_bytes_budget"])
        yield gauge("colibri_rss_bytes", "resident set size of this process",
                    self.process.memory_info().rss)
        info = GaugeMetricFamily("colibri_model_info", "the model version serving",
                                 labels=["version", "path"])
        info.add_metric([engine.version, engine.path], 1)
        yield info
        counted = [("colibri_reloads", "model reloads done", self.holder.reloads),
                   ("colibri_reload_failures", "reloads refused", self.holder.failed_reloads)]
        if "draft_tokens" in s:                       # serve --draft: speculative decoding
            counted += [("colibri_draft_tokens", "draft tokens verified (this model version)",
                         s["draft_tokens"]),
                        ("colibri_draft_accepted_tokens", "draft tokens accepted (this model "
                         "version)", s["accepted_tokens"])]
        for name, doc, value in counted:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        yield from _prefix_metrics(s["prefix_cache"])
        shards = engine.model.expert_shards
        if shards is not None:                        # serve --expert-shards
            yield from _shard_metrics(shards.stats())


def _shard_metrics(st: dict):
    """Per expert shard (ExpertShards.stats()), labelled shard="0".."N-1"."""
    for key, kind, doc in (
            ("calls", CounterMetricFamily, "layer calls answered by the expert shard"),
            ("slots", CounterMetricFamily, "token-expert pairs the expert shard computed"),
            ("seconds", CounterMetricFamily, "seconds from sending a layer call to the "
             "expert shard to its answer (sum; / calls: the mean round trip)"),
            ("failures", CounterMetricFamily, "layer calls the expert shard failed (its "
             "actor died, raised or timed out)"),
            ("experts", GaugeMetricFamily, "experts (of all MoE layers) the shard owns")):
        m = kind(f"colibri_expert_shard_{key}", doc, labels=["shard"])
        for row in st["per_shard"]:
            m.add_metric([str(row["shard"])], row[key])
        yield m


def _prefix_metrics(p: dict):
    """The prefix cache's counters and gauges (PrefixCache.stats())."""
    for key, doc in (("hits", "prompt tokens copied from the prefix cache"),
                     ("misses", "prompt tokens looked up in the prefix cache and computed"),
                     ("lookups", "prompts looked up in the prefix cache"),
                     ("evictions", "prefix-cache blocks evicted (LRU)")):
        c = CounterMetricFamily(f"colibri_prefix_cache_{key}", doc)
        c.add_metric([], p[key])
        yield c
    for key, name, doc in (("bytes", "bytes", "bytes of K/V the prefix cache holds"),
                           ("capacity_bytes", "capacity_bytes", "bytes the prefix cache may hold "
                            "(0: off); within the KV budget the running requests leave"),
                           ("blocks", "blocks", "blocks the prefix cache holds")):
        g = GaugeMetricFamily(f"colibri_prefix_cache_{name}", doc)
        g.add_metric([], p[key])
        yield g


class Metrics:
    """The registry of one app and the counters its routes increment."""

    def __init__(self, holder: ModelHolder):
        self.registry = CollectorRegistry()
        self.rate = TokenRate()
        self.requests = Counter("colibri_requests", "HTTP requests answered",
                                ["route", "status"], registry=self.registry)
        self.prompt_tokens = Counter("colibri_prompt_tokens", "prompt tokens of served requests",
                                     registry=self.registry)
        self.completion_tokens = Counter("colibri_completion_tokens", "tokens generated",
                                         registry=self.registry)
        self.registry.register(_EngineCollector(holder, self.rate))

    def text(self) -> bytes:
        return generate_latest(self.registry)


ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                    "/metrics", "/admin/reload"})


class CountRequests:
    """ASGI middleware: colibri_requests_total{route, status} for every http response (paths
    outside ROUTES count as route="other", so probing cannot grow the label set)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else ("/v1/models" if path.startswith("/v1/models/")
                                             else "other")

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)
        await self.app(scope, receive, counted)
