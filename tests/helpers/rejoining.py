"""One rank of a process group that loses a peer (tests/unit/test_rejoin.py): ``python -m
tests.helpers.rejoining RENDEZVOUS RANK DIE_AT_STEP OUT`` all-reduces a tensor STEPS times in
generations of worker/rejoin.py; with DIE_AT_STEP >= 0 this process SIGKILLs itself at that step of
its first generation. It writes the generation it finished in, its pid and the sum to OUT."""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from trainforge.worker.rejoin import Rendezvous, run_rejoining

STEPS = 5


def main() -> None:
    rendezvous, rank, die_at, out = (
        Rendezvous(**json.loads(sys.argv[1])),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
    )
    resets = []

    def run(generation: int) -> dict[str, float]:
        total = torch.ones(1)
        for step in range(STEPS):
            if generation == 0 and step == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(total)
        return {"generation": generation, "sum": total.item(), "pid": os.getpid(), "resets": len(resets)}

    result = run_rejoining(rendezvous, rank, run, max_rejoins=1, reset=lambda: resets.append(1))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
