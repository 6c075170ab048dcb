"""Offline and serving benchmarks (vllm bench latency|throughput|serve)."""
