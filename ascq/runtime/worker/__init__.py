"""The worker: loads the model, allocates the KV cache, runs forward steps (eager, fused decode, graphs)
and samples."""
