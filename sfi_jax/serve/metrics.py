"""Prometheus metrics of one server: the Engine's state read at each scrape (queue, slots,
tokens/s, slow/fast steps), the server's own request and token counters, and latency histograms
fed by the Engine's observers (called from its scheduler thread; prometheus_client is
thread-safe)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "sfi_jax"
# seconds: from a CPU's tens of milliseconds per token to a long prompt's minutes of prefill
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

_GAUGES = {"queue_length": "requests waiting for a slot",
           "prefilling": "requests being prefilled",
           "active_slots": "slots running a request",
           "max_slots": "slots of the engine",
           "decode_tokens_per_s": "recent decode throughput of the engine, tokens per second"}
_COUNTERS = {"slow_steps": "SFI slow (dense, refreshing) decode steps",
             "fast_steps": "SFI fast (sparse) decode steps",
             "dense_steps": "decode steps of the dense program (mode dense, or SFI chunks "
                            "whose requests all fit the budget)",
             "tokens_generated": "tokens the engine generated",
             "requests_finished": "requests the engine finished"}


class _EngineCollector:
    """engine.metrics() as gauges and counters, read when scraped."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        snap = self.engine.metrics()
        for key, doc in _GAUGES.items():
            if key in snap:
                g = GaugeMetricFamily(f"{PREFIX}_{key}", doc)
                g.add_metric([], float(snap[key]))
                yield g
        for key, doc in _COUNTERS.items():
            if key in snap:
                c = CounterMetricFamily(f"{PREFIX}_engine_{key}", doc)
                c.add_metric([], float(snap[key]))
                yield c


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of finished "
                                     "requests", registry=r)
        self.completion_tokens = Counter(f"{PREFIX}_completion_tokens", "tokens sent to "
                                         "clients", registry=r)
        self.histograms = {
            "ttft_s": Histogram(f"{PREFIX}_time_to_first_token_seconds", "from submit to the "
                                "first token", buckets=_TTFT_BUCKETS, registry=r),
            "itl_s": Histogram(f"{PREFIX}_inter_token_latency_seconds", "between consecutive "
                               "tokens of a request", buckets=_ITL_BUCKETS, registry=r),
            "e2e_s": Histogram(f"{PREFIX}_e2e_request_latency_seconds", "from submit to the "
                               "last token", buckets=_TTFT_BUCKETS, registry=r),
        }
        engine.observers.append(self.observe)

    def observe(self, kind: str, value: float) -> None:
        """The Engine's observer: one latency sample of `kind`."""
        h = self.histograms.get(kind)
        if h is not None:
            h.observe(value)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
