"""The run's placement group cleaner (driver/cleaner.py) on a real local Ray: with Ray's state API
answering for another cluster (which made Ray Train's own cleaner remove a live controller's group
in three runs by hand; its monitor thread can also die first on a loaded machine, so that is not a
test here), trainforge's keeps the group while the controller lives and removes it once the
controller is dead; every run's trainer carries trainforge's in place of Ray's."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import ray
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2.api.config import ScalingConfig
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table

from tests.helpers.faults import wait_until
from tests.helpers.timing import scaled
from trainforge.driver.cleaner import OwnClusterCleaner, controller_state
from trainforge.driver.trainer import OwnClusterCleanerCallback, RunTrainer

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.slow]


class Stranger(BaseHTTPRequestHandler):
    """Another cluster's Ray state API: it knows no actor of ours."""

    def do_GET(self) -> None:
        body = json.dumps({"result": True, "msg": "", "data": {"result": {"result": [], "total": 0}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def stranger_env() -> Iterator[dict[str, str]]:
    """An actor's environment that points Ray's state API at the stranger (as RAY_API_SERVER_ADDRESS,
    RAY_ADDRESS, a newer `ray start` or a forwarded dashboard on 127.0.0.1:8265 can)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stranger)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{server.server_address[1]}"}
    server.shutdown()


@ray.remote(num_cpus=0)
class Controller:
    def ping(self) -> bool:
        return True


def controller_and_group() -> tuple[Any, str, PlacementGroup]:
    controller = Controller.remote()  # type: ignore[attr-defined]
    assert ray.get(controller.ping.remote(), timeout=scaled(60))
    group = placement_group([{"CPU": 0.01}])
    ray.get(group.ready(), timeout=scaled(60))
    return controller, controller._actor_id.hex(), group


def state(group: PlacementGroup) -> str:
    return placement_group_table(group)["state"]


def watching(cleaner_class: type, group: PlacementGroup, env: dict[str, str], *args: Any, **kwargs: Any) -> Any:
    """A cleaner actor of ``cleaner_class`` in ``env``, given ``group`` and watching."""
    cleaner = ray.remote(cleaner_class).options(num_cpus=0, runtime_env={"env_vars": env}).remote(*args, **kwargs)
    ray.get(cleaner.register_placement_group.remote(group), timeout=scaled(60))
    cleaner.start_monitoring.remote()
    return cleaner


def test_trainforge_cleaner_keeps_a_live_controllers_group_then_removes_a_dead_ones(
    stranger_env: dict[str, str],
) -> None:
    controller, controller_id, group = controller_and_group()
    cleaner = watching(OwnClusterCleaner, group, stranger_env, controller_id, 0.1)
    wait_until(lambda: ray.get(cleaner.checks.remote()) >= 5, 60, "five looks at the controller")
    assert state(group) == "CREATED"

    ray.kill(controller)
    wait_until(lambda: state(group) == "REMOVED", 60, "the cleaner to remove the dead controller's group")
    # The cleaner ends itself once its work is done.
    wait_until(lambda: controller_state(cleaner._actor_id.hex()) == "DEAD", 60, "the cleaner's end")


def test_a_stopped_cleaner_leaves_the_group_to_its_controller() -> None:
    controller, controller_id, group = controller_and_group()
    cleaner = watching(OwnClusterCleaner, group, {}, controller_id, 0.1)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(cleaner.stop.remote(), timeout=scaled(60))  # the normal end: it exits
    ray.kill(controller)
    assert state(group) == "CREATED"
    ray.util.remove_placement_group(group)


def test_a_runs_trainer_carries_trainforges_cleaner_in_place_of_rays() -> None:
    trainer = RunTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    kinds = [type(callback) for callback in trainer._create_default_callbacks()]
    assert OwnClusterCleanerCallback in kinds
    assert not any(issubclass(kind, PlacementGroupCleanerCallback) for kind in kinds)
