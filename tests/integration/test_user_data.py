"""data.factory end to end: a user's data module (tests/helpers/user_data.py) trains in a Ray
Train worker, and a factory that returns the wrong thing stops the run with one line."""

from __future__ import annotations

from pathlib import Path

import pytest

import trainforge
from tests.helpers.runs import tiny_run
from trainforge.errors import DataError

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.mark.slow  # a Ray Train run of 60 steps with validation and the run's report: over 10 s
def test_a_user_data_factory_trains(tmp_path: Path) -> None:
    config = tiny_run(
        tmp_path,
        data={"name": "factory", "factory": "tests.helpers.user_data:digits"},
        train={"max_steps": 60, "batch_size": 32},
        optim={"name": "adamw", "lr": 0.01},
    )
    summary = trainforge.fit(config).summary
    final = summary["final_metrics"]
    assert summary["status"] == "finished" and summary["global_step"] == 60
    assert summary["config"]["data"]["factory"] == "tests.helpers.user_data:digits"
    assert final["val/accuracy"] > 0.7  # on the 360 held-out digits the factory returned as its val set (chance: 0.1)


def test_a_factory_returning_the_wrong_type_stops_the_run_in_one_line(tmp_path: Path) -> None:
    """The DataError (raised on the driver, which calls the factory once to learn whether it
    streams) reaches the caller as is."""
    data = {"name": "factory", "factory": "tests.helpers.user_data:wrong_type"}
    config = tiny_run(tmp_path, data=data, failure={"max_failures": 2})
    with pytest.raises(DataError) as caught:
        trainforge.fit(config)
    message = str(caught.value)
    assert message.startswith("data.factory 'tests.helpers.user_data:wrong_type' returned list, expected")
    assert "trainforge.data.UserData" in message and "\n" not in message
