"""Where this worker sits on its node: its rank among the node's workers."""

from __future__ import annotations

import os


def local_rank() -> int:
    """The ``LOCAL_RANK`` variable where it is set (Ray Train's torch backend, a warm worker group
    and a rejoining worker set it as torchrun does: worker/warm.py, worker/rejoin.py); else Ray
    Train's local rank inside a Ray Train run, 0 elsewhere."""
    import ray.train

    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    try:
        return int(ray.train.get_context().get_local_rank())
    except RuntimeError:  # not inside a Ray Train training function
        return int(os.environ.get("LOCAL_RANK", "0"))
