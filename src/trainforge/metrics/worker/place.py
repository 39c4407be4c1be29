"""Where this worker sits on its node: its rank among the node's workers."""

from __future__ import annotations

import os


def local_rank() -> int:
    """Ray Train's local rank inside a Ray Train run; elsewhere (a warm worker group, worker/warm.py,
    which sets it as torchrun does) the ``LOCAL_RANK`` variable, 0 when unset."""
    import ray.train

    try:
        return int(ray.train.get_context().get_local_rank())
    except RuntimeError:  # not inside a Ray Train training function
        return int(os.environ.get("LOCAL_RANK", "0"))
