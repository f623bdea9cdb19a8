"""Prometheus metrics of one server (`/metrics`), in a registry of its own per app.

Gauges and token counters are read from `Engine.stats()` at each scrape; latencies are
observed per request as its outputs arrive (`RequestTimer`), from the engine's own time
stamps (`time.monotonic()`): time to first token, inter-token latency, end-to-end latency.
"""

from __future__ import annotations

from rocketkv_jax.serve import _extra

try:  # the serve extra
  from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
  from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError as e:
  raise _extra.missing(e) from None

from rocketkv_jax.runtime.requests import Output

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0)


class _EngineCollector:
  """The engine's state at scrape time."""

  def __init__(self, engine):
    self._engine = engine

  def describe(self):
    return []  # names are known only at collect time; nothing to pre-register

  def collect(self):
    s = self._engine.stats()
    for name, doc, value in (
        ("num_requests_running", "Requests holding a decode slot.", s.num_running),
        ("num_requests_waiting", "Requests waiting for a decode slot.", s.num_waiting),
        ("num_slots", "Decode slots (requests that can run at once).", s.num_slots),
        ("kv_cache_usage_perc",
         "Fraction (0-1) of the KV pool in use (its pages; without pages, the slots' tokens).",
         s.kv_cache_usage)):
      yield GaugeMetricFamily(f"rocketkv:{name}", doc, value=value)
    for name, doc, value in (
        ("prompt_tokens", "Prompt tokens of admitted requests.", s.prompt_tokens_total),
        ("generation_tokens", "Generated tokens.", s.generation_tokens_total),
        ("prefill_seconds", "Wall seconds the engine spent prefilling prompts.",
         s.prefill_seconds_total),
        ("decode_seconds", "Wall seconds the engine spent in decode steps.",
         s.decode_seconds_total),
        ("num_preemptions", "Requests preempted (lazy pages: the pool ran dry) to be "
         "recomputed.", s.num_preemptions),
        ("recomputed_tokens", "Generated tokens regenerated after preemptions.",
         s.recomputed_tokens_total)):
      yield CounterMetricFamily(f"rocketkv:{name}", doc, value=value)


class Metrics:
  """A server's metrics; `render()` is the `/metrics` body."""

  def __init__(self, engine):
    self.registry = CollectorRegistry(auto_describe=False)
    self.registry.register(_EngineCollector(engine))
    kw = dict(registry=self.registry)
    self.ttft = Histogram("rocketkv:time_to_first_token_seconds",
                          "Time from arrival to the first generated token.",
                          buckets=_LATENCY_BUCKETS, **kw)
    self.itl = Histogram("rocketkv:inter_token_latency_seconds",
                         "Time between generated tokens (a call of K steps counts K tokens).",
                         buckets=_LATENCY_BUCKETS, **kw)
    self.e2e = Histogram("rocketkv:e2e_request_latency_seconds",
                         "Time from arrival to the last output.", buckets=_E2E_BUCKETS, **kw)
    self.finished = Counter("rocketkv:request_success", "Finished requests by finish reason.",
                            ["finished_reason"], **kw)

  def render(self) -> bytes:
    return generate_latest(self.registry)

  def timer(self) -> "RequestTimer":
    return RequestTimer(self)


class RequestTimer:
  """Observes one request's latencies from its `(time, Output)` events."""

  def __init__(self, metrics: Metrics):
    self._m = metrics
    self._last: float | None = None  # time of the previous event that carried tokens

  def observe(self, t: float, out: Output) -> None:
    if out.token_ids:
      if self._last is None and out.first_token_time is not None:
        self._m.ttft.observe(out.first_token_time - out.arrival_time)
        self._last = out.first_token_time
        rest = len(out.token_ids) - 1
      else:
        rest = len(out.token_ids)
      if rest and self._last is not None:
        gap = max(t - self._last, 0.0) / rest
        for _ in range(rest):
          self._m.itl.observe(gap)
        self._last = t
    if out.finished:
      self._m.e2e.observe(max(t - out.arrival_time, 0.0))
      self._m.finished.labels(out.finish_reason).inc()
