"""Objects given to ``trainforge.fit(model=..., data=...)`` (models/passed.py): what is refused in
one line before Ray starts, what every worker's copy holds, and a run directory that names them.
The 2-worker run of a model defined in ``__main__`` is tests/integration/test_passed_objects.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import trainforge
from tests.helpers.runs import tiny_run
from tests.helpers.timing import scaled
from trainforge.config import load_config, load_run_config
from trainforge.config.factories import PASSED_DATA, PASSED_MODEL
from trainforge.data import UserData
from trainforge.errors import ConfigError, DataError, ModelError
from trainforge.models import build_model, passed
from trainforge.protocol import PassedObjects


class Net(nn.Module):
    def __init__(self, hidden: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Stream(IterableDataset):
    def __iter__(self) -> Iterator[Any]:
        yield torch.zeros(1), torch.zeros(())


@pytest.fixture
def objects_gone() -> Iterator[None]:
    yield
    passed.install(None)


def config_without_model(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    config = tiny_run(tmp_path, **sections)
    del config["model"]
    return config


def test_an_unpicklable_attribute_is_named_in_one_line() -> None:
    net = Net()
    net.body[1].lock = threading.Lock()  # type: ignore[assignment]
    with pytest.raises(ModelError) as caught:
        passed.pack(net)
    message = str(caught.value)
    assert message.startswith("model=Net cannot be shipped to the workers: model.body.1.lock is a _thread.lock")
    assert "model.factory: 'package.module:function'" in message and "\n" not in message


def test_objects_of_other_kinds_are_refused_naming_what_is_taken() -> None:
    with pytest.raises(ModelError, match=r"^model= takes a torch.nn.Module, or a function or class .* got int$"):
        passed.pack(model=3)
    with pytest.raises(
        DataError, match=r"^data= takes a map-style torch Dataset .* got tests.unit.test_passed.Stream$"
    ):
        passed.pack(data=UserData(train=Stream()))


def test_a_model_too_large_to_ship_says_to_use_a_factory() -> None:
    # 800 M parameters on the meta device: counted, never allocated nor pickled.
    with pytest.raises(ModelError) as caught:
        passed.pack(nn.Linear(40_000, 20_000, device="meta"))
    message = str(caught.value)
    assert message.startswith("model=Linear is 2.98 GiB of parameters and buffers, over the 2.00 GiB")
    assert message.endswith("build it on each worker instead with model.factory: 'package.module:function'")
    # What the pickled bytes weigh beyond the tensors counts too.
    heavy = Net()
    heavy.table = bytes(2 << 20)  # type: ignore[assignment]
    with pytest.raises(ModelError, match=r"^model=Net is 2\.0 MiB pickled, over the 1\.0 MiB"):
        passed.pack(heavy, limit=1 << 20)
    with pytest.raises(ModelError, match="meta device"):
        passed.pack(nn.Linear(4, 4, device="meta"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_model_on_a_gpu_is_asked_for_on_the_cpu() -> None:
    with pytest.raises(ModelError, match=r"^model=Net has tensors on cuda:0; pass it on the CPU \(model.cpu\(\)\)"):
        passed.pack(Net().cuda())


def test_every_copy_starts_from_the_instances_own_weights(objects_gone: None) -> None:
    net = Net()
    with torch.no_grad():
        net.head.weight.fill_(0.25)
    shipped = passed.pack(net)
    passed.install(shipped)
    torch.manual_seed(1234)  # a worker seeds before it builds: a copy is never initialised again
    first, second = passed.model(), passed.model()
    assert first is not second and first is not net
    for copy in (first, second):
        assert all(
            torch.equal(a, b) for a, b in zip(copy.state_dict().values(), net.state_dict().values(), strict=True)
        )
    with torch.no_grad():
        first.head.weight.zero_()
    assert torch.all(second.head.weight == 0.25)  # each build its own copy
    with pytest.raises(ModelError, match=r"model.kwargs \['hidden'\] cannot be applied to model=Net, an instance"):
        passed.model(hidden=8)


def test_a_class_or_function_is_called_on_each_worker_with_model_kwargs(objects_gone: None) -> None:
    passed.install(passed.pack(Net))
    assert passed.model(hidden=8).head.in_features == 8
    passed.install(passed.pack(lambda: "not a module"))
    with pytest.raises(ModelError, match=r"^model=<lambda>\(\) returned str, expected a torch.nn.Module$"):
        passed.model()


def test_bytes_a_worker_cannot_unpickle_are_one_line(objects_gone: None) -> None:
    passed.install(PassedObjects(model=b"not a pickle", model_name="Net"))
    with pytest.raises(ModelError, match=r"^model=Net: this worker could not unpickle it \(UnpicklingError"):
        passed.model()


def test_a_users_module_is_shipped_by_value(tmp_path: Path) -> None:
    """A class of the caller's own module file unpickles in a process that cannot import it."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "my_net_module.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            class MyNet(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.fc = nn.Linear(3, 2)

                def forward(self, x):
                    return self.fc(x) * 2
            """
        )
    )
    sys.path.insert(0, str(folder))
    try:
        import my_net_module  # type: ignore[import-not-found]

        shipped = passed.pack(my_net_module.MyNet())
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("my_net_module", None)
    assert shipped.model is not None
    (tmp_path / "model.pkl").write_bytes(shipped.model)
    read = "import pickle, torch; m = pickle.load(open('model.pkl', 'rb')); print(tuple(m(torch.ones(1, 3)).shape))"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", read], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(60)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(1, 2)"


def test_the_config_names_the_objects_in_place_of_the_sources(tmp_path: Path, caplog: Any) -> None:
    config = tiny_run(tmp_path, data={"name": "digits", "val_fraction": 0.1, "shuffle": False})
    named = passed.config_naming(config, model=True, data=True)
    resolved = load_config(named)
    assert resolved.model.factory == PASSED_MODEL and resolved.model.name is None
    assert getattr(resolved.data, "factory", None) == PASSED_DATA
    assert resolved.data.val_fraction == 0.1 and resolved.data.shuffle is False  # type: ignore[union-attr]
    assert "model= takes the place of the config's model.name" in caplog.text
    assert config["model"] == {"name": "mlp"}  # the caller's dict is left as it was
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({**config, "data": {"name": "parquet", "path": "x.parquet"}}))
    caplog.clear()
    assert passed.config_naming(path, model=False, data=True)["data"] == {"name": "factory", "factory": PASSED_DATA}  # type: ignore[index]
    assert "data= takes the place of the config's data source: data.path not read" in caplog.text
    caplog.clear()  # a run directory's config.yaml, given with its objects again: nothing to say
    recorded = load_config(named).to_dict()
    assert passed.config_naming(recorded, model=True, data=True)["model"]["factory"] == PASSED_MODEL  # type: ignore[index]
    assert "takes the place" not in caplog.text


def test_fit_checks_an_instance_before_ray_starts(tmp_path: Path) -> None:
    """The driver's output check traces the instance on a training sample, as for a factory's model."""
    import ray

    with pytest.raises(ModelError, match=r"^the model gives 3 outputs per prediction but the data has 10 classes"):
        trainforge.fit(config_without_model(tmp_path), model=Net(classes=3))
    with pytest.raises(DataError, match=r"classification needs num_classes >= 2"):
        data = TensorDataset(torch.randn(40, 1, 8, 8), torch.zeros(40, dtype=torch.long))
        trainforge.fit(config_without_model(tmp_path), model=Net(), data=data)
    assert not ray.is_initialized()
    assert passed.current() is None  # the objects are the fit call's only


def test_a_run_directory_naming_objects_says_to_pass_them_again(tmp_path: Path) -> None:
    """A re-run or an export of such a run, without the object, is one line, not a traceback."""
    config = config_without_model(tmp_path)
    config["model"] = {"factory": PASSED_MODEL}
    with pytest.raises(ModelError) as caught:
        trainforge.fit(config)
    message = str(caught.value)
    assert "the model object given to trainforge.fit(model=...), which is not kept with the run" in message
    assert "call trainforge.fit(config, model=...) with it again" in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"^RUN_DIR x: config.yaml: model.factory: trainforge.models.passed:model is"):
        load_run_config(config, "RUN_DIR x: config.yaml", trust=True)
    with pytest.raises(DataError, match=r"the data object given to trainforge\.fit"):
        passed.data(load_config({**config, "data": {"factory": PASSED_DATA}}).data, 0)  # type: ignore[arg-type]
    with pytest.raises(ModelError, match=r"the model object given to trainforge\.fit"):
        build_model(load_config(config).model, None)  # type: ignore[arg-type]
