"""Prometheus metrics of the gateway (prometheus-client), in a registry of its own per app."""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


class Recent:
    """The last minute's requests, for `GET /status` (a page polls it every few seconds):
    TTFTs, each finished request's mean inter-token gap, generated tokens, and goodput against
    the service level targets. Prometheus' histograms answer over all time; a rate over a window
    is PromQL's job, and the page must work without a Prometheus server. Bounded: at most `limit`
    events of each kind kept."""

    def __init__(self, window_s: float = 60.0, limit: int = 100_000):
        self.window_s = window_s
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=limit)
        self._tokens: deque[tuple[float, int]] = deque(maxlen=limit)
        self._finished: deque[tuple[float, float, float | None]] = deque(maxlen=limit)  # (at, TTFT, mean gap)
        self._lock = threading.Lock()

    def ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttfts.append((time.monotonic(), seconds))

    def tokens(self, count: int) -> None:
        with self._lock:
            self._tokens.append((time.monotonic(), count))

    def finished(self, ttft_s: float, mean_gap_s: float | None) -> None:
        """A request that streamed tokens ended: its TTFT and its mean gap (None: one token)."""
        with self._lock:
            self._finished.append((time.monotonic(), ttft_s, mean_gap_s))

    def snapshot(self, ttft_slo_s: float | None = None, itl_slo_s: float | None = None) -> dict:
        since = time.monotonic() - self.window_s
        with self._lock:
            ttfts = sorted(value for at, value in self._ttfts if at >= since)
            tokens = sum(count for at, count in self._tokens if at >= since)
            finished = [(ttft, gap) for at, ttft, gap in self._finished if at >= since]
        gaps = [gap for _, gap in finished if gap is not None]
        snapshot = {
            "window_s": self.window_s,
            "requests": len(ttfts),
            "ttft_p50_s": _quantile(ttfts, 10),
            "ttft_p95_s": _quantile(ttfts, 19),
            "itl_p50_s": _quantile(gaps, 10),
            "tokens_per_s": tokens / self.window_s,
            "goodput": None,
        }
        if ttft_slo_s is not None or itl_slo_s is not None:
            good = [
                (ttft_slo_s is None or ttft <= ttft_slo_s) and (itl_slo_s is None or gap is None or gap <= itl_slo_s)
                for ttft, gap in finished
            ]
            snapshot["goodput"] = {
                "ttft_slo_s": ttft_slo_s,
                "itl_slo_s": itl_slo_s,
                "finished": len(good),
                "share": sum(good) / len(good) if good else None,
                "requests_per_s": sum(good) / self.window_s,
            }
        return snapshot


def _quantile(values: list[float], twentieth: int) -> float | None:
    """The `twentieth`/20 quantile (inclusive method); None without values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(sorted(values), n=20, method="inclusive")[twentieth - 1]


class GatewayMetrics:
    def __init__(self):
        self.recent = Recent()
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "lazyserve_ttft_seconds", "time to first token, as the gateway saw it", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "lazyserve_inter_token_latency_seconds",
            "time between streamed token batches per token",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "lazyserve_e2e_latency_seconds", "request start to last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.requests = Counter("lazyserve_requests", "requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("lazyserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("lazyserve_completion_tokens", "generated tokens", registry=r)
        self.computed_fraction = Histogram(
            "lazyserve_computed_fraction",
            "token-layers computed / the full model's, per request",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=r,
        )
        self.kv_bytes = Counter(
            "lazyserve_kv_transfer_bytes", "KV transfer stream bytes, prefill to decode", registry=r
        )
        self.routing = Counter("lazyserve_routing_decisions", "routing decisions", ["kind", "policy"], registry=r)
        self.retries = Counter(
            "lazyserve_retries", "requests retried on another worker before the first token", registry=r
        )
        # The prefix cache, per worker that prefilled (its address): tokens looked up and found.
        self.prefix_queried = Counter(
            "lazyserve_prefix_cache_queried_tokens", "prompt tokens looked up in a prefix cache", ["worker"], registry=r
        )
        self.prefix_hit = Counter(
            "lazyserve_prefix_cache_hit_tokens", "prompt tokens found in a prefix cache", ["worker"], registry=r
        )
        self.prefix_bytes = Gauge(
            "lazyserve_prefix_cache_bytes", "bytes a worker's prefix cache holds", ["worker"], registry=r
        )
        self.prefix_evictions = Gauge(
            "lazyserve_prefix_cache_evictions", "blocks a worker's prefix cache has evicted", ["worker"], registry=r
        )
        self.in_flight = Gauge(
            "lazyserve_in_flight_requests", "requests admitted (past their caller's bound) and not ended", registry=r
        )
        # Every completion request received ends in exactly one `lazyserve_requests` outcome: ok,
        # cancelled (the client went away), failed (an error event mid-stream), client_error (4xx
        # but 429), queue_full (429), deadline (504), server_error (other 5xx).
        self.received = Counter("lazyserve_requests_received", "completion requests received", registry=r)
        self.queue_depth = Gauge(
            "lazyserve_queue_depth", "requests waiting for their caller's bound or a worker's room", registry=r
        )
        self.queue_wait = Histogram(
            "lazyserve_queue_wait_seconds",
            "time from arrival to admission, per admission step (0 when nothing had to wait)",
            buckets=(0.0, *LATENCY_BUCKETS, 256, 512),
            registry=r,
        )
        self.rejections = Counter(
            "lazyserve_rejections",
            "requests refused or given up while waiting, by reason (queue_full, too_large, deadline, cancelled)",
            ["reason"],
            registry=r,
        )
        self.prefill_queued = Gauge(
            "lazyserve_prefill_queued",
            "predicted prefill cost (full-model prompt tokens) this gateway placed on each worker and not yet "
            "prefilled: the queue its routes predict waits from",
            ["worker"],
            registry=r,
        )
        self.prefill_wait = Histogram(
            "lazyserve_prefill_wait_seconds",
            "from a prompt's placement to its first token, waiting in the prefilling worker's queue included",
            ["route", "worker"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requeued = Counter(
            "lazyserve_requeued", "attempts a full decode worker refused, put back in the queue", registry=r
        )
        # A choice whose decode worker failed (reason "failed") or drained ("drained") after its
        # first token, continued on a live worker (services.router.dispatch).
        self.degraded = Gauge(
            "lazyserve_degraded",
            "1 while this gateway serves without Redis (the workers it last saw, its own counts), else 0",
            registry=r,
        )
        self.migrations = Counter(
            "lazyserve_migrations", "streamed choices continued on another worker, by reason", ["reason"], registry=r
        )
        self.migrated_tokens = Counter(
            "lazyserve_migrated_tokens",
            "tokens a migrated choice had already streamed (replayed, not resent)",
            registry=r,
        )
        self.migration_gap = Histogram(
            "lazyserve_migration_gap_seconds",
            "from a choice's worker failing to its continuation's first new token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
