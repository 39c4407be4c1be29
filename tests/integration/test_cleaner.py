"""The run's placement group cleaner (driver/cleaner.py) on a real local Ray: Ray Train's own
cleaner, when the Ray state API it finds answers for another cluster, removes the group of a
controller that is alive; trainforge's keeps it while the controller lives and removes it once the
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
from ray.train.v2._internal.execution.controller.placement_group_cleaner import PlacementGroupCleaner
from ray.train.v2.api.config import ScalingConfig
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table

from tests.helpers.faults import wait_until
from tests.helpers.timing import scaled
from trainforge.driver.cleaner import OwnClusterCleaner, OwnClusterCleanerCallback, RunTrainer, controller_state

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


def test_rays_cleaner_removes_a_live_controllers_group_when_another_cluster_answers(
    stranger_env: dict[str, str],
) -> None:
    controller, controller_id, group = controller_and_group()
    cleaner = (
        ray.remote(PlacementGroupCleaner)
        .options(num_cpus=0, runtime_env={"env_vars": stranger_env})
        .remote(controller_actor_id=controller_id, check_interval_s=0.1, get_actor_timeout_s=5, stop_timeout=5)
    )
    ray.get(cleaner.register_placement_group.remote(group), timeout=scaled(60))
    cleaner.start_monitoring.remote()
    wait_until(lambda: state(group) == "REMOVED", 60, "Ray's cleaner to remove the group")
    # The controller never died: Ray's cleaner took "unknown to that server" for "dead". If this
    # fails, Ray's cleaner no longer does, and driver/cleaner.py may be retired.
    assert ray.get(controller.ping.remote(), timeout=scaled(30))
    ray.kill(controller)


def test_trainforge_cleaner_keeps_a_live_controllers_group_then_removes_a_dead_ones(
    stranger_env: dict[str, str],
) -> None:
    controller, controller_id, group = controller_and_group()
    cleaner = (
        ray.remote(OwnClusterCleaner)
        .options(num_cpus=0, runtime_env={"env_vars": stranger_env})
        .remote(controller_id, 0.1)
    )
    ray.get(cleaner.register_placement_group.remote(group), timeout=scaled(60))
    cleaner.start_monitoring.remote()
    wait_until(lambda: ray.get(cleaner.checks.remote()) >= 5, 60, "five looks at the controller")
    assert state(group) == "CREATED"

    ray.kill(controller)
    wait_until(lambda: state(group) == "REMOVED", 60, "the cleaner to remove the dead controller's group")
    # The cleaner ends itself once its work is done.
    wait_until(lambda: controller_state(cleaner._actor_id.hex()) == "DEAD", 60, "the cleaner's end")


def test_a_stopped_cleaner_leaves_the_group_to_its_controller() -> None:
    controller, controller_id, group = controller_and_group()
    cleaner = ray.remote(OwnClusterCleaner).options(num_cpus=0).remote(controller_id, 0.1)
    ray.get(cleaner.register_placement_group.remote(group), timeout=scaled(60))
    cleaner.start_monitoring.remote()
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
