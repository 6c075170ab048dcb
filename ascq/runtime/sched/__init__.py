"""Scheduling: requests, the KV block manager with prefix caching, and the vLLM-v1-style scheduler."""
