"""The data section as a union discriminated by data.name (config/data.py) and the one registry of
sources (data/registry.py): every name validates to its own section, a key the source does not read
is refused naming it, an unknown name is one line with a did-you-mean from every command that
validates a config, and the streamed-or-in-memory decision is the registry's. No Ray."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.runs import tiny_run
from trainforge.config import (
    DataConfig,
    DigitsData,
    FactoryData,
    ParquetData,
    StreamedData,
    SyntheticData,
    TokensData,
    load_config,
    to_yaml,
    validate,
)
from trainforge.config.data import SECTIONS, WHOLE_SECTION_KEYS
from trainforge.data import MAP_STYLE, REGISTRY, build_datasets, open_stream, source_of
from trainforge.data.registry import check_local_paths
from trainforge.errors import ConfigError, DataError

BASE: dict[str, Any] = {"model": {"name": "mlp"}, "train": {"max_steps": 1}}
# What each source needs besides its name to validate (and, for the factory, to be a factory).
NEEDS: dict[str, dict[str, Any]] = {"factory": {"factory": "tests.helpers.user_data:digits"}}
TYPO_LINE = (
    "unknown data.name 'parqet' (did you mean 'parquet'?): choose one of cifar10, digits, factory, imagefolder, "
    "synthetic, tokens, or a streamed source: images, jsonl, parquet"
)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``trainforge ARGS`` in this process: exit code, stdout, stderr."""
    from trainforge.cli import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, re.sub(r"\x1b\[[0-9;]*m", "", err)


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registered_source_round_trips_through_config_validation(name: str) -> None:
    config = load_config({**BASE, "data": {"name": name, **NEEDS.get(name, {})}}, env={})
    assert type(config.data) is REGISTRY[name].section is SECTIONS[name]
    assert config.data.name == name and source_of(config.data) is REGISTRY[name]
    dumped = config.to_dict()
    again = load_config(dumped, env={})
    assert again.data == config.data and again.to_dict() == dumped
    assert load_config(yaml.safe_load(to_yaml(config)), env={}).data == config.data  # config.yaml read back


def test_the_registry_and_the_config_union_name_the_same_sources() -> None:
    assert set(REGISTRY) == set(SECTIONS)
    for name, source in REGISTRY.items():
        assert source.name == name and (source.build is not None or source.stream is not None)
        assert source.streamed == issubclass(source.section, StreamedData), name
    assert {"synthetic", "digits", "cifar10", "imagefolder", "factory", "tokens"} == MAP_STYLE
    assert load_config(BASE, env={}).data == DigitsData()  # data left out: digits


def test_config_show_refuses_a_typo_in_data_name_with_the_line_train_gives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_run(tmp_path, data={"name": "parqet", "path": "/data"})))
    code, out, err = cli(capsys, "config", "show", str(path))
    assert code == 2 and out == "" and "Traceback" not in err
    assert error_lines(err) == [f"error: {TYPO_LINE}"]
    for command in (["train"], ["plan"], ["predict", "--gpus", "1"]):
        code, _, err = cli(capsys, *command, str(path))
        assert code == 2 and error_lines(err) == [f"error: {TYPO_LINE}"], command
    assert not (tmp_path / "t").exists()


def test_config_show_refuses_a_key_the_source_does_not_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_run(tmp_path)))
    code, _, err = cli(capsys, "config", "show", str(path), "--set", "data.seq_len=128")
    assert code == 2
    assert error_lines(err) == [
        "error: data.seq_len needs data.name: synthetic or tokens; data.name digits does not read it"
    ]
    code, out, _ = cli(capsys, "config", "show", str(path), "--set", "data.name=tokens", "--set", "data.seq_len=128")
    assert code == 0 and yaml.safe_load(out)["data"] == {
        "name": "tokens",
        "shuffle": True,
        "num_workers": 0,
        "pin_memory": None,
        "path": None,
        "seq_len": 128,
        "windows": "random",
        "prepare": None,
    }


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"name": "digits", "windows": "sequential"},
            "data.windows needs data.name: tokens; data.name digits does not",
        ),
        ({"name": "cifar10", "val_fraction": 0.1}, "data.val_fraction needs data.name: imagefolder, images, jsonl,"),
        ({"name": "synthetic", "image_size": 224}, "data.image_size needs data.name: imagefolder, images or parquet;"),
        ({"name": "tokens", "vocab_size": 50}, "data.vocab_size needs data.name: synthetic; data.name tokens does"),
        ({"name": "images", "num_classes": 3}, "data.num_classes needs data.name: jsonl, parquet or synthetic;"),
        ({"name": "parquet", "kind": "tokens"}, "data.kind needs data.name: synthetic; data.name parquet does not"),
        ({"name": "digits", "prepare": {"inputs": ["x"]}}, "data.prepare needs data.name: tokens and data.path"),
        ({"name": "tokens", "seq_lne": 8}, "unknown key data.seq_lne — did you mean data.seq_len?"),
        (
            {"name": "parquet", "columns": {"inptu": "x"}},
            "unknown key data.columns.inptu — did you mean data.columns.input?",
        ),
        (
            {"name": "parquet", "num_workers": 2},
            "data.num_workers = 2: streamed sources are decoded in Ray Data's tasks",
        ),
        ({"name": "factory"}, "data.name factory needs data.factory: 'package.module:function'"),
        ({"name": "cifar10", "factory": "a.b:c"}, "data.name 'cifar10' and data.factory 'a.b:c' both say where"),
        ({"factory": "not a path"}, "data.factory = 'not a path': must look like 'package.module:function'"),
        ({"name": "synthetic", "num_samples": 0}, "data.num_samples = 0: Input should be greater than or equal to 1"),
        # the bound on data.input_shape, on a source that has the key (test_config_hostile.py meets digits)
        ({"name": "parquet", "input_shape": [3, 10**8]}, "data.input_shape.1 = 100000000: Input should be less than"),
        ({"name": 7}, "unknown data.name 7: choose one of cifar10, digits,"),
        ({"name": "cifar"}, "unknown data.name 'cifar' (did you mean 'cifar10'?): choose one of"),
    ],
)
def test_a_data_section_is_refused_in_one_line_naming_the_key(data: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({**BASE, "data": data}, env={})
    message = str(caught.value)
    assert message.startswith(expected) and "\n" not in message, message


def test_a_factory_is_the_source_with_or_without_a_name() -> None:
    path = "tests.helpers.user_data:digits"
    for data in ({"factory": path}, {"name": "factory", "factory": path}, {"name": "digits", "factory": path}):
        config = load_config({**BASE, "data": {**data, "seq_len": 8, "val_path": "/v"}}, env={})
        assert isinstance(config.data, FactoryData) and source_of(config.data).name == "factory"
    assert load_config({**BASE, "data": {"factory": path}}, env={}).to_dict()["data"]["name"] == "factory"


def test_data_config_builds_the_section_its_keys_name() -> None:
    assert type(DataConfig(name="synthetic", kind="tokens")) is SyntheticData
    assert type(DataConfig(factory="a.b:c", num_samples=3)) is FactoryData
    assert type(DataConfig.model_validate({"name": "tokens", "path": "/c"})) is TokensData
    assert type(DataConfig.model_validate({})) is DigitsData
    assert isinstance(ParquetData(path="x"), StreamedData | DataConfig)
    bare = DataConfig(name="zzz")  # no source: the config refuses it, no builder builds it
    with pytest.raises(DataError, match=r"unknown data\.name 'zzz'"):
        build_datasets(bare, seed=0)
    with pytest.raises(ConfigError, match=r"^unknown data\.name 'zzz': choose one of"):
        validate({**BASE, "data": bare})


def test_an_older_runs_resolved_config_reads_back() -> None:
    """config.yaml of a run from before sections were per source lists every key of the one section."""
    old: dict[str, Any] = {
        "name": "tokens", "path": "/corpus", "val_path": None, "factory": None, "augment": None,
        "columns": {"input": None, "target": None}, "windows": "sequential", "prepare": None,
        "shuffle_buffer": 1024, "prefetch_batches": 2,
        "kind": "image", "input_shape": [3, 32, 32], "num_classes": 10, "num_samples": 1024, "seq_len": 16,
        "vocab_size": 1000, "val_fraction": 0.2, "image_size": None, "num_workers": 0, "pin_memory": None,
        "shuffle": True,
    }  # fmt: skip
    assert set(old) == WHOLE_SECTION_KEYS
    data = load_config({**BASE, "data": old}, env={}).data
    assert data == TokensData(path="/corpus", windows="sequential", seq_len=16)
    factory = load_config({**BASE, "data": {**old, "name": "digits", "factory": "a.b:c"}}, env={}).data
    assert isinstance(factory, FactoryData) and factory.factory == "a.b:c" and factory.seq_len == 16
    with pytest.raises(ConfigError, match=r"data\.windows needs data\.name: tokens"):  # a hand-written one is checked
        load_config({**BASE, "data": {"name": "digits", "windows": "random"}}, env={})


def test_the_driver_decides_streamed_or_in_memory_once_from_the_registry(tmp_path: Path) -> None:
    assert open_stream(DigitsData(), seed=0) is None  # the workers build it
    assert open_stream(DataConfig(factory="tests.helpers.user_data:digits"), seed=0) is None  # map-style sets
    assert REGISTRY["parquet"].streamed and not REGISTRY["factory"].streamed
    with pytest.raises(DataError, match=r"data\.name jsonl is streamed by Ray Data .* this needs one of cifar10,"):
        build_datasets(DataConfig(name="jsonl", path=str(tmp_path)), seed=0)


def test_the_drivers_path_check_knows_each_sources_keys(tmp_path: Path) -> None:
    check_local_paths(DigitsData())
    with pytest.raises(DataError, match=r"data\.path /nowhere does not exist \(data\.name cifar10\)"):
        check_local_paths(DataConfig(name="cifar10", path="/nowhere"))
    (tmp_path / "a.jsonl").write_text('{"input": [1], "target": 0}\n')
    check_local_paths(DataConfig(name="jsonl", path=str(tmp_path)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"^data\.val_path .*empty holds no \.jsonl/\.json files"):
        check_local_paths(DataConfig(name="jsonl", path=str(tmp_path), val_path=str(tmp_path / "empty")))
