"""Hostile config input (issue 9, section 4): every bad file, override or variable is one ConfigError
of one line, naming the key or file and what is allowed, within a second; never another exception."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.timing import rescaled
from trainforge.config import Config, load_config, parse_override, to_yaml
from trainforge.config.safeyaml import MAX_DEPTH, MAX_FILE_BYTES, MAX_NODES, load_yaml, read_yaml_file
from trainforge.errors import ConfigError, TrainforgeError

BASE = "model: {name: mlp}\ntrain: {max_steps: 10}\n"
BASE_DICT: dict[str, Any] = {"model": {"name": "mlp"}, "train": {"max_steps": 10}}
BILLION_LAUGHS = """model:
  name: mlp
  kwargs:
    a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
    b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
    c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
    d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
    e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
    f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
    g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
    h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
train: {max_steps: 1}
"""


def refused(source: Any, *fragments: str, overrides: tuple[str, ...] = (), env: dict[str, str] | None = None) -> str:
    """Load and expect one ConfigError of one line that holds every fragment, within a second (on the
    quiet machine; stretched by the load)."""
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config(source, overrides, env={} if env is None else env)
    elapsed = time.perf_counter() - start
    message = str(err.value)
    assert "\n" not in message and len(message) < 400, message
    for fragment in fragments:
        assert fragment in message, message
    assert elapsed < rescaled(1.0), f"{elapsed:.2f} s: {message}"  # no blow-up: 1 s quiet, stretched by the load
    return message


def write(tmp_path: Path, content: str | bytes, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


# --- the file: encoding, size, kind --------------------------------------------------------------


def test_binary_and_non_utf8_files_are_refused(tmp_path: Path) -> None:
    refused(write(tmp_path, b"\xff\xfe\x00\x01binary"), "is not UTF-8 text (byte 0xff at offset 0)")
    refused(write(tmp_path, "model: {name: caf\u00e9}\n".encode("latin-1")), "is not UTF-8 text", "save it as UTF-8")
    refused(write(tmp_path, b"a: \x00\n"), "not valid YAML", "#x0000")


def test_a_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, b"\xef\xbb\xbf" + BASE.encode()), env={}).model.name == "mlp"


def test_directory_oversized_and_special_files(tmp_path: Path) -> None:
    refused(tmp_path, f"config file {tmp_path} is a directory")
    refused(tmp_path / "absent.yaml", "does not exist")
    refused(write(tmp_path, BASE + "#" * MAX_FILE_BYTES), f"larger than {MAX_FILE_BYTES // 1024} KiB")
    if Path("/dev/null").exists():
        refused(Path("/dev/null"), "is not a regular file")


# --- YAML structure: depth, aliases, duplicate keys, constructor errors -------------------------


@pytest.mark.parametrize("opening", ["[", "{a: ", "- "])
def test_deep_nesting_is_refused_without_recursion_error(tmp_path: Path, opening: str) -> None:
    refused(write(tmp_path, (opening * 100_000)[:MAX_FILE_BYTES]), f"nested deeper than {MAX_DEPTH} levels")


def test_nesting_up_to_the_limit_is_fine() -> None:
    def nested(levels: int) -> str:  # a mapping, a mapping, then `levels` lists around a scalar
        return "a: {b: " + "[" * levels + "1" + "]" * levels + "}"

    assert load_yaml(nested(MAX_DEPTH - 3), "test")["a"]["b"]
    with pytest.raises(ConfigError, match="nested deeper"):
        load_yaml(nested(MAX_DEPTH - 2), "test")


def test_alias_bomb_is_refused_within_a_second(tmp_path: Path) -> None:
    assert len(BILLION_LAUGHS) < 500
    refused(write(tmp_path, BILLION_LAUGHS), f"more than {MAX_NODES} values", "aliases")


def test_ordinary_anchors_and_merge_keys_still_work() -> None:
    text = "defaults: &d {max_steps: 10, batch_size: 8}\n"
    data = load_yaml(text + "train: {<<: *d, batch_size: 16}\nlist: &l [1, 2]\nagain: *l\n", "test")
    assert data["train"] == {"max_steps": 10, "batch_size": 16}  # a merged key may be overridden
    assert data["again"] == [1, 2]


def test_recursive_and_undefined_aliases(tmp_path: Path) -> None:
    refused(write(tmp_path, "a: &a [1, *a]\n"), "alias *a refers to a node that holds it")
    refused(write(tmp_path, "a: *nowhere\n"), "not valid YAML at line 1", "undefined alias")


def test_duplicate_keys_name_the_key_and_both_lines(tmp_path: Path) -> None:
    refused(write(tmp_path, BASE + "optim: {lr: 0.1}\noptim: {lr: 0.2}\n"), "duplicate key 'optim'", "line 4", "line 3")
    refused(write(tmp_path, BASE + "optim: {lr: 0.1, lr: 0.2}\n"), "duplicate key 'lr'")
    refused(write(tmp_path, BASE + "model: {name: mlp}\n"), "at line 3: duplicate key 'model' (first at line 1)")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("seed: 2001-13-01\n", "month must be in 1..12"),
        ("seed: " + "9" * 5000 + "\n", "4300 digits"),
        ("a: !!binary caf\u00e9\n", "base64"),
        ("a: !!python/object:os.system {}\n", "could not determine a constructor"),
        ("? [1, 2]\n: x\n", "unhashable"),
        ("a: 1\n---\nb: 2\n", "but found another document"),
        ("[1, 2]\n", "must hold a mapping of sections, got list"),
    ],
)
def test_constructor_errors_become_config_errors(tmp_path: Path, text: str, fragment: str) -> None:
    refused(write(tmp_path, text), fragment)


def test_long_values_are_clipped_in_messages(tmp_path: Path) -> None:
    message = refused(write(tmp_path, BASE + "run: {name: " + "x" * 100_000 + "}\n"), "run.name", "...")
    assert len(message) < 300
    message = refused(write(tmp_path, BASE + "? " + "k" * 100_000 + "\n: 1\n"), "unknown key kkk")
    assert len(message) < 300


def test_a_space_file_goes_through_the_same_reader(tmp_path: Path) -> None:
    from trainforge.tune.space import load_space

    base = load_config(BASE_DICT, env={})
    for content, fragment in [
        (BILLION_LAUGHS, "more than"),
        ("[" * 10_000, "nested deeper"),
        (b"\xff", "not UTF-8"),
        ("optim.lr: {uniform: [0, 1]}\noptim.lr: {uniform: [0, 2]}\n", "duplicate key 'optim.lr'"),
    ]:
        with pytest.raises(ConfigError, match="space file") as err:
            load_space(write(tmp_path, content, "space.yaml"), base)
        assert fragment in str(err.value)
    with pytest.raises(ConfigError, match="is a directory"):
        read_yaml_file(tmp_path, "space file")


# --- values: finite numbers, upper bounds, plain data ---------------------------------------------


@pytest.mark.parametrize("number", [".inf", "-.inf", ".nan", ".NaN"])
@pytest.mark.parametrize(
    "key",
    ["optim.lr", "train.grad_clip_norm", "data.val_fraction", "failure.collective_timeout_s", "tune.time_budget_s"],
)
def test_non_finite_numbers_are_refused_everywhere(tmp_path: Path, key: str, number: str) -> None:
    section, name = key.split(".")
    extra = "max_steps: 1, " if section == "train" else ""
    text = f"model: {{name: mlp}}\n{section}: {{{extra}{name}: {number}}}\n"
    if section != "train":
        text += "train: {max_steps: 1}\n"
    refused(write(tmp_path, text), key, "finite number")


def test_non_finite_numbers_in_free_form_sections() -> None:
    refused(BASE_DICT, "model.kwargs", "x.y = inf: numbers must be finite", overrides=("model.kwargs={x: {y: .inf}}",))
    refused(
        BASE_DICT, "scaling.resources_per_worker", "finite", overrides=("scaling.resources_per_worker={CPU: .nan}",)
    )
    refused(BASE_DICT, "tune.scheduler_params", overrides=("tune.scheduler_params={asha: {max_t: .inf}}",))


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("train.batch_size=1.0e+26", "train.batch_size"),
        ("train.batch_size=100000000", "train.batch_size = 100000000: Input should be less than or equal to 16777216"),
        (
            "scaling.num_workers=100000000",
            "scaling.num_workers = 100000000: Input should be less than or equal to 10000",
        ),
        ("scaling.num_workers=[1, 100000000]", "less than or equal to 10000"),
        ("train.max_steps=100000000000", "train.max_steps"),
        ("train.epochs=10000000", "train.epochs"),
        ("train.grad_accum_steps=10000000", "train.grad_accum_steps"),
        ("optim.lr=10000", "optim.lr = 10000: Input should be less than or equal to 1000"),
        ("seed=4294967296", "seed"),
        ("data.input_shape=[3, 100000000]", "data.input_shape"),
        ("tune.num_trials=10000000", "tune.num_trials"),
        ("run.output_dir=" + "d" * 5000, "run.output_dir"),
    ],
)
def test_upper_bounds(override: str, fragment: str) -> None:
    refused(BASE_DICT, fragment, overrides=(override,))


def test_bounds_hold_for_environment_variables() -> None:
    refused(BASE_DICT, "train.batch_size", env={"TRAINFORGE_TRAIN__BATCH_SIZE": "1.0e+26"})
    refused(BASE_DICT, "optim.lr = inf", env={"TRAINFORGE_OPTIM__LR": ".inf"})
    refused(
        BASE_DICT, "environment TRAINFORGE_MODEL__KWARGS", "nested deeper", env={"TRAINFORGE_MODEL__KWARGS": "[" * 999}
    )


def test_free_form_sections_hold_plain_data_only() -> None:
    refused(BASE_DICT, "model.kwargs", "bytes is not allowed", overrides=("model.kwargs={b: !!binary aGk=}",))
    refused(BASE_DICT, "model.kwargs", "set is not allowed", overrides=("model.kwargs={s: !!set {a}}",))
    refused(BASE_DICT, "model.kwargs", "date is not allowed", overrides=("model.kwargs={d: 2020-01-01}",))
    refused(BASE_DICT, "model.kwargs", overrides=("model.kwargs={1: 2}",))
    config = load_config(
        BASE_DICT, ["model.kwargs={hidden: [4, 4], act: relu, p: 0.5, flag: true, none: null}"], env={}
    )
    assert config.model.kwargs["hidden"] == [4, 4]
    assert load_config({**BASE_DICT, "model": {"name": "mlp", "kwargs": {"h": (4, 4)}}}, env={})


def test_ordinary_values_at_the_bounds_are_accepted() -> None:
    config = load_config(
        BASE_DICT,
        ["train.batch_size=16777216", "scaling.num_workers=[1, 10000]", "optim.lr=1000", "seed=4294967295"],
        env={},
    )
    assert config.train.batch_size == 1 << 24 and config.scaling.max_workers == 10_000


# --- --set: the same limits, text that is not YAML stays a string --------------------------------


def test_set_values_share_the_file_limits() -> None:
    refused(BASE_DICT, "--set model.kwargs", "nested deeper", overrides=("model.kwargs=" + "[" * 60_000,))
    bomb = "{" + BILLION_LAUGHS.split("kwargs:\n")[1].split("train:")[0].replace("\n    ", ", ").strip(" ,\n") + "}"
    refused(BASE_DICT, "--set model.kwargs", "more than", overrides=(f"model.kwargs={bomb}",))
    refused(BASE_DICT, "--set model.kwargs", "duplicate key 'a'", overrides=("model.kwargs={a: 1, a: 2}",))
    refused(BASE_DICT, "longer than", overrides=("run.name=" + "x" * 100_000,))
    assert parse_override("run.name=[unclosed") == ("run.name", "[unclosed")
    assert parse_override("model.kwargs={when: 2001-13-01}") == ("model.kwargs", "{when: 2001-13-01}")


# --- fuzz: any bytes, any text, any override -> a Config or a TrainforgeError ------------------

FUZZ = settings(max_examples=200, deadline=1000, suppress_health_check=[HealthCheck.function_scoped_fixture])
KEYS = st.sampled_from(
    ["model", "train", "optim", "scaling", "data", "name", "kwargs", "max_steps", "lr", "batch_size", "num_workers"]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS | st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
YAML_SOUP = st.text(alphabet=list("[]{}:,-&*!?|>'\"#%@`\n\t ab01.e+~<"), max_size=300)


def load_or_refuse(path: Path) -> None:
    try:
        config = load_config(path, env={})
    except TrainforgeError as err:
        assert "\n" not in str(err)
        return
    assert isinstance(config, Config)
    assert math.isfinite(config.optim.lr)
    to_yaml(config)  # a valid config always writes out


@FUZZ
@given(content=st.binary(max_size=2000))
def test_fuzz_any_bytes_as_a_config_file(tmp_path: Path, content: bytes) -> None:
    load_or_refuse(write(tmp_path, content, "fuzz.yaml"))


@FUZZ
@given(content=st.text(max_size=500) | YAML_SOUP)
def test_fuzz_any_text_as_a_config_file(tmp_path: Path, content: str) -> None:
    load_or_refuse(write(tmp_path, content.encode(), "fuzz.yaml"))


@FUZZ
@given(sections=st.dictionaries(KEYS | st.text(max_size=8), VALUES, max_size=6))
def test_fuzz_structured_configs(tmp_path: Path, sections: dict[Any, Any]) -> None:
    sections.setdefault("model", {"name": "mlp"})
    sections.setdefault("train", {"max_steps": 1})
    load_or_refuse(write(tmp_path, yaml.safe_dump(sections, allow_unicode=True), "fuzz.yaml"))


SCHEMA_SHAPED = st.fixed_dictionaries(
    {
        "model": st.fixed_dictionaries({"name": st.just("mlp")}, optional={"kwargs": VALUES}),
        "train": st.fixed_dictionaries(
            {"max_steps": st.integers(-5, 10**12)},
            optional={"batch_size": SCALARS, "grad_clip_norm": SCALARS, "epochs": VALUES},
        ),
    },
    optional={
        "optim": st.dictionaries(st.sampled_from(["lr", "eps", "betas", "name", "momentum"]), VALUES, max_size=3),
        "scaling": st.dictionaries(st.sampled_from(["num_workers", "resources_per_worker"]), VALUES, max_size=2),
        "tune": st.dictionaries(st.sampled_from(["scheduler_params", "num_trials"]), VALUES, max_size=2),
        "data": st.dictionaries(st.sampled_from(["input_shape", "num_samples", "val_fraction"]), VALUES, max_size=3),
        "seed": SCALARS,
        "precision": SCALARS,
    },
)


@FUZZ
@given(sections=SCHEMA_SHAPED)
def test_fuzz_schema_shaped_configs(tmp_path: Path, sections: dict[str, Any]) -> None:
    """Known keys with any values: the validators' paths, not just the parser's."""
    load_or_refuse(write(tmp_path, yaml.safe_dump(sections, allow_unicode=True), "fuzz.yaml"))


@FUZZ
@given(
    item=st.text(max_size=200)
    | st.builds(lambda k, v: f"{k}={v}", st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}){0,2}", fullmatch=True), YAML_SOUP)
)
def test_fuzz_set_overrides(item: str) -> None:
    try:
        config = load_config(BASE_DICT, [item], env={})
    except TrainforgeError as err:
        assert "\n" not in str(err)
        return
    assert isinstance(config, Config)
