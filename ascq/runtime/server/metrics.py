"""Prometheus metrics of the server, with vLLM's metric names so existing vLLM dashboards work unchanged.

Engine-side numbers (running/waiting requests, KV usage, token and preemption counters) are copied from
`LLMEngine.get_stats()` after every engine step; latencies are observed by the engine thread as outputs
arrive. `ascq:` metrics are ours (block counts, for leak checks).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ENGINE_INDEX = "0"
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

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
# engine counter (cumulative in get_stats) -> the prometheus counter attributes it feeds (vLLM counts every
# prompt token as a prefix-cache query)
ENGINE_COUNTERS = {
    "num_prompt_tokens": ("prompt_tokens", "prefix_cache_queries"),
    "num_generation_tokens": ("generation_tokens",),
    "num_cached_prompt_tokens": ("prefix_cache_hits",),
    "num_preemptions": ("preemptions",),
    "spec_decode_num_drafts": ("spec_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_num_accepted_tokens",),
}


class ServerMetrics:
    """One registry per server, so several servers (or tests) in one process do not collide."""

    def __init__(self, model_name: str, cache_config: dict[str, Any] | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]  # vLLM's labels; one engine core, index 0
        values = (model_name, ENGINE_INDEX)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

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
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Arrival to first scheduled.", E2E_BUCKETS
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "First scheduled to first token.", E2E_BUCKETS
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "First token to finish.", E2E_BUCKETS
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds", "First scheduled to finish.", E2E_BUCKETS
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "A request's decode time per token after the first.",
            ITL_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Time between consecutive tokens (vLLM's older name).",
            ITL_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Tokens run in one engine step.", ITERATION_TOKENS_BUCKETS
        )
        cache_labels = sorted((cache_config or {}).items())
        info = Gauge(
            "vllm:cache_config_info",
            "The KV cache's configuration (value 1).",
            labels + [k for k, _ in cache_labels],
            registry=r,
        )
        info.labels(*values, *(str(v) for _, v in cache_labels)).set(1)
        self._finished = Counter(
            "vllm:request_success", "Finished requests by reason.", labels + ["finished_reason"], registry=r
        )
        self.label_values = values
        self._last_stats: dict[str, int] = {}

    def update_from_stats(self, stats: dict[str, Any]) -> None:
        self.num_running.set(stats["num_running"])
        self.num_waiting.set(stats["num_waiting"])
        self.kv_cache_usage.set(stats["kv_cache_usage"])
        self.num_free_blocks.set(stats["num_free_blocks"])
        self.num_total_blocks.set(stats["num_total_blocks"])
        self.spec_acceptance_rate.set(stats.get("spec_decode_acceptance_rate", 0.0))
        self.spec_mean_acceptance_length.set(stats.get("spec_decode_mean_acceptance_length", 0.0))
        if stats.get("num_step_tokens"):
            self.iteration_tokens.observe(stats["num_step_tokens"])
        for key, attributes in ENGINE_COUNTERS.items():
            delta = int(stats[key]) - self._last_stats.get(key, 0)
            if delta > 0:
                for attribute in attributes:
                    getattr(self, attribute).inc(delta)
            self._last_stats[key] = int(stats[key])

    def observe_finished(self, finish_reason: str) -> None:
        self._finished.labels(*self.label_values, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
