"""How this process joins the ranks: spawned by rank 0 / `--node-rank` (tcp://), or started by torchrun
(env://)."""

from __future__ import annotations

import os


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another env:// launcher) started it, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"])
    return None


def is_headless(node_rank: int) -> bool:
    """A node other than node 0, or a torchrun rank other than 0: it runs ranks, not the server."""
    return node_rank > 0 or (torchrun_rank() or 0) > 0
