"""failure.replace: worker without Ray (worker/rejoin.py): real processes in a gloo group over a
real TCPStore, one SIGKILLed mid-collective; the survivor keeps its process, rejoins, and finishes
with the replacement. With Ray Train replacing the worker: tests/faults/test_exact_resume.py."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers.rejoining import STEPS
from tests.helpers.runs import tiny_run
from trainforge.config import load_config
from trainforge.errors import ConfigError
from trainforge.worker.rejoin import Rendezvous, lost_peer

ROOT = Path(__file__).resolve().parents[2]


def rank_process(
    rendezvous: Rendezvous, rank: int, die_at: int, out: Path, *unfit: str, stderr: int | None = None
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "tests.helpers.rejoining",
        rendezvous.to_env(),
        str(rank),
        str(die_at),
        str(out),
        *unfit,
    ]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stderr=stderr)


@pytest.mark.slow  # real processes start torch: out of the fast subset
def test_a_survivor_keeps_its_process_and_finishes_with_the_replacement_of_a_killed_peer(tmp_path: Path) -> None:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    rendezvous = Rendezvous("127.0.0.1", store.port, "run1", world=2, backend="gloo", timeout_s=60)
    survivor = rank_process(rendezvous, 0, -1, tmp_path / "survivor.json")
    doomed = rank_process(rendezvous, 1, 2, tmp_path / "doomed.json")
    assert doomed.wait(timeout=120) == -9  # killed itself at its third all-reduce, in the first generation
    replacement = rank_process(rendezvous, 1, -1, tmp_path / "replacement.json")  # as Ray Train starts one
    assert replacement.wait(timeout=120) == 0 and survivor.wait(timeout=120) == 0
    kept, new = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("survivor", "replacement"))
    # The survivor's own process, reset once, in the second generation, beside the replacement.
    assert kept["pid"] == survivor.pid and kept["resets"] == 1 and kept["generation"] == 1
    assert new["generation"] == 1 and new["resets"] == 0
    assert kept["sum"] == new["sum"] == 2.0**STEPS  # a whole run of collectives in the new group
    assert not (tmp_path / "doomed.json").exists()
    assert store.add("run1/joins", 0) == 4  # two first joins, the survivor's rejoin, the replacement's


@pytest.mark.slow  # real processes start torch: out of the fast subset
def test_a_survivor_whose_process_cannot_be_vouched_for_fails_instead_of_rejoining(tmp_path: Path) -> None:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    rendezvous = Rendezvous("127.0.0.1", store.port, "run2", world=2, backend="gloo", timeout_s=60)
    unfit = "a C extension loaded from outside the libraries"
    survivor = rank_process(rendezvous, 0, -1, tmp_path / "survivor.json", unfit, stderr=subprocess.PIPE)
    doomed = rank_process(rendezvous, 1, 2, tmp_path / "doomed.json")
    assert doomed.wait(timeout=120) == -9
    _, err = survivor.communicate(timeout=120)
    assert survivor.returncode != 0 and not (tmp_path / "survivor.json").exists()
    assert f"rank 0 lost a peer and cannot rejoin: this process is not as a new one ({unfit})" in err.decode()
    assert store.add("run2/joins", 0) == 2  # it never joined a second generation


def test_only_a_collective_that_lost_a_peer_is_a_lost_peer() -> None:
    gloo = RuntimeError(
        "[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:740: Connection reset by peer"
    )
    assert lost_peer(gloo)
    assert lost_peer(RuntimeError("Got the following error when running the callback: boom")) is False
    wrapped = ValueError("while saving")
    wrapped.__cause__ = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:17316")
    assert lost_peer(wrapped)
    assert not lost_peer(ValueError("mat1 and mat2 shapes cannot be multiplied"))


@pytest.mark.parametrize(
    ("sections", "said"),
    [
        ({"failure": {"replace": "node"}}, "failure.replace"),
        ({"scaling": {"num_workers": [1, 2]}}, "failure.replace worker needs a fixed scaling.num_workers"),
        ({"failure": {"preemption": {"notice": "aws"}}}, "failure.preemption.notice aws needs failure.replace: group"),
    ],
)
def test_what_failure_replace_worker_cannot_do_is_refused_in_one_line(
    tmp_path: Path, sections: dict, said: str
) -> None:
    failure = {"replace": "worker", **sections.get("failure", {})}
    with pytest.raises(ConfigError) as err:
        load_config(tiny_run(tmp_path, **{**sections, "failure": failure}), env={})
    assert said in str(err.value) and "\n" not in str(err.value)
    assert err.value.exit_code == 2
