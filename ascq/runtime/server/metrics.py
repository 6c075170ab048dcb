"""Prometheus metrics of the server, with vLLM's metric names so existing vLLM dashboards work unchanged.

Engine-side numbers (running/waiting requests, KV usage, token and preemption counters) are copied from
`LLMEngine.get_stats()` after every engine step; latencies are observed by the engine thread as outputs
arrive. `ascq:` metrics are ours (block counts, for leak checks).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
# engine counter (cumulative in get_stats) -> prometheus counter attribute
ENGINE_COUNTERS = {
    "num_prompt_tokens": "prompt_tokens",
    "num_generation_tokens": "generation_tokens",
    "num_preemptions": "preemptions",
    "spec_decode_num_drafts": "spec_num_drafts",
    "spec_decode_num_draft_tokens": "spec_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_num_accepted_tokens",
}


class ServerMetrics:
    """One registry per server, so several servers (or tests) in one process do not collide."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_running = gauge("vllm:num_requests_running", "Requests in the engine's running batch.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self.num_free_blocks = gauge("ascq:num_free_blocks", "Free KV-cache blocks.")
        self.num_total_blocks = gauge("ascq:num_total_blocks", "KV-cache blocks in total.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted for lack of KV blocks.")
        self.spec_num_drafts = counter("vllm:spec_decode_num_drafts", "Speculative proposals verified.")
        self.spec_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified.")
        self.spec_num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted."
        )
        self.spec_acceptance_rate = gauge(
            "vllm:spec_decode_draft_acceptance_rate", "Accepted / proposed tokens since start."
        )
        self.spec_mean_acceptance_length = gauge(
            "ascq:spec_decode_mean_acceptance_length",
            "Tokens emitted per verification (accepted + 1) since start.",
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", E2E_BUCKETS
        )
        self._finished = Counter(
            "vllm:request_success", "Finished requests by reason.", labels + ["finished_reason"], registry=r
        )
        self.model_name = model_name
        self._last_stats: dict[str, int] = {}

    def update_from_stats(self, stats: dict[str, Any]) -> None:
        self.num_running.set(stats["num_running"])
        self.num_waiting.set(stats["num_waiting"])
        self.kv_cache_usage.set(stats["kv_cache_usage"])
        self.num_free_blocks.set(stats["num_free_blocks"])
        self.num_total_blocks.set(stats["num_total_blocks"])
        self.spec_acceptance_rate.set(stats.get("spec_decode_acceptance_rate", 0.0))
        self.spec_mean_acceptance_length.set(stats.get("spec_decode_mean_acceptance_length", 0.0))
        for key, attribute in ENGINE_COUNTERS.items():
            delta = int(stats[key]) - self._last_stats.get(key, 0)
            if delta > 0:
                getattr(self, attribute).inc(delta)
            self._last_stats[key] = int(stats[key])

    def observe_finished(self, finish_reason: str) -> None:
        self._finished.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
