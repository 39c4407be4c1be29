"""One rank of a process group that loses a peer (tests/unit/test_rejoin.py): ``python -m
tests.helpers.rejoining RENDEZVOUS RANK DIE_AT_STEP OUT [UNFIT]`` all-reduces a tensor STEPS times in
generations of worker/rejoin.py; with DIE_AT_STEP >= 0 this process SIGKILLs itself at that step of
its first generation; with UNFIT its reset says the process cannot be vouched for. It writes the
generation it finished in, its pid and the sum to OUT."""

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
    unfit = sys.argv[5] if len(sys.argv) > 5 else None  # what the reset says of the process
    resets: list[int] = []

    def reset() -> str | None:
        resets.append(1)
        return unfit

    def run(generation: int) -> dict[str, float]:
        total = torch.ones(1)
        for step in range(STEPS):
            if generation == 0 and step == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(total)
        return {"generation": generation, "sum": total.item(), "pid": os.getpid(), "resets": len(resets)}

    result = run_rejoining(rendezvous, rank, run, max_rejoins=1, reset=reset)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
