"""Loading a config: file -> ``--set`` overrides -> ``TRAINFORGE_SECTION__KEY`` environment ->
validation, with one-line errors that name the key and what is allowed."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, Tag, ValidationError

from trainforge.config.data import DataConfig, foreign_key_message, unknown_source_message
from trainforge.config.factories import PASSED_DATA, PASSED_MODEL, import_from_working_directory, passed_again
from trainforge.config.safeyaml import MAX_DEPTH, MAX_TEXT_CHARS, YamlRefused, load_yaml, read_yaml_file
from trainforge.config.schema import ENV_PREFIX, Config
from trainforge.errors import CheckpointError, ConfigError
from trainforge.redact import redact_config, remember_secrets


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | Config,
    overrides: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
) -> Config:
    """Build a validated Config from a YAML path, a dict or a Config, then apply the layers."""
    if isinstance(source, Config):
        raw: dict[str, Any] = source.to_dict()
    elif isinstance(source, Mapping):
        raw = _deep_copy(source)
    else:
        raw = read_yaml(Path(source))
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value, origin=f"--set {item}")
    for key, value in env_overrides(os.environ if env is None else env).items():
        set_dotted(raw, key, value, origin=f"environment {ENV_PREFIX}{key.upper().replace('.', '__')}")
    return validate(raw)


TRUST_FLAG = "--trust-run-config"


def code_keys(config: Config) -> list[tuple[str, str]]:
    """Every key of ``config`` that names code to import and call (``"package.module:function"``),
    with its value: ``model.factory``, ``data.factory``, ``parallel.tp_plan``, ``optim.factory``,
    ``callbacks[i]``."""
    named = [("model.factory", config.model.factory), ("parallel.tp_plan", config.parallel.tp_plan)]
    named.insert(1, ("data.factory", getattr(config.data, "factory", None)))
    named.append(("optim.factory", config.optim.factory))
    named += [(f"callbacks[{index}]", callback.path) for index, callback in enumerate(config.callbacks)]
    return [(key, str(value)) for key, value in named if value]


def checkpoint_run_config(
    recorded: Mapping[str, Any] | None, checkpoint: str, run_dir: Path, config_path: Path | None, *, trust: bool
) -> Config:
    """The config a checkpoint was trained with (``export``, ``evaluate``): the checkpoint's own
    record (verified with it), else the run directory's ``config_path``; a CheckpointError when
    neither is there. ``checkpoint`` names it in errors."""
    if recorded:
        return load_run_config(recorded, f"checkpoint {checkpoint}", trust=trust)
    if config_path is not None:
        return load_run_config(config_path, f"RUN_DIR {run_dir}: {config_path.name}", trust=trust)
    raise CheckpointError(f"RUN_DIR {run_dir}: neither config.yaml nor a config in {Path(checkpoint).name}")


def load_run_config(source: str | os.PathLike[str] | Mapping[str, Any], origin: str, *, trust: bool) -> Config:
    """A config read back from a run directory or a checkpoint (``generate``, ``export``): data, not
    code. Run directories are shared and downloaded, and whoever wrote one chose its factories: one
    that names code to import is refused unless the user vouches for it (``trust``, the CLI's
    ``--trust-run-config``). Nothing is imported here; code the user trusts imports later from the
    working directory too, as the run's workers imported it."""
    config = load_config(source)
    named = code_keys(config)
    for key, value in named:
        if value in (PASSED_MODEL, PASSED_DATA):
            raise ConfigError(f"{origin}: {passed_again(key, value)}")
    if named and not trust:
        key, value = named[0]
        raise ConfigError(
            f"{origin} names code to import ({key}: {_clip(value)}); a run directory's config is data, "
            f"not code: add {TRUST_FLAG} if you trust whoever wrote it"
        )
    if named:
        import_from_working_directory()
    return config


def read_yaml(path: Path) -> dict[str, Any]:
    """A config file's sections, read within safeyaml's bounds (size, depth, aliases, duplicate keys)."""
    data = read_yaml_file(path, "config file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """``train.batch_size=64`` -> ("train.batch_size", 64); the value is parsed as YAML."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        raise ConfigError(f"--set {item!r}: expected key=value with a dotted key, e.g. train.batch_size=64")
    return key, parse_value(text, f"--set {key}")


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """``TRAINFORGE_TRAIN__BATCH_SIZE=64`` -> {"train.batch_size": 64}; ``__`` separates levels."""
    found: dict[str, Any] = {}
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        key = name[len(ENV_PREFIX) :].lower().replace("__", ".")
        found[key] = parse_value(text, f"environment {name}")
    return found


def parse_value(text: str, origin: str) -> Any:
    """An override's value as YAML (``64``, ``true``, ``[1, 2]``); text that is not YAML stays a string.

    The file's limits hold here too: depth, alias expansion and duplicate keys are errors, not strings.
    """
    if len(text) > MAX_TEXT_CHARS:
        raise ConfigError(f"{origin}: the value is longer than {MAX_TEXT_CHARS} characters")
    if not text.strip():
        return ""
    try:
        return load_yaml(text, origin)
    except YamlRefused:
        raise
    except ConfigError:
        return text


def set_dotted(raw: dict[str, Any], key: str, value: Any, origin: str) -> None:
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {'.'.join(parts[: depth + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def validate(raw: Mapping[str, Any]) -> Config:
    remember_secrets(raw)  # masked in every message of this process, whatever quotes them (redact.py)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err)) from None


def describe_validation_error(err: ValidationError) -> str:
    """Turn pydantic's report into one line per problem that names the key and what is allowed."""
    errors = err.errors()
    # A union (scaling.num_workers: N or [min, max]) reports one error per member; when a bound
    # was broken, "should be a valid tuple" only adds noise.
    bounded = {_key(e) for e in errors if not str(e["type"]).endswith("_type")}
    kept = [e for e in errors if not (str(e["type"]).endswith("_type") and _key(e) in bounded)]
    # A number or a word (train.batch_size: 64 or auto): the number's problem, the word as the
    # alternative, on one line.
    words = {_key(e): str(e["msg"]).removeprefix("Input should be ") for e in kept if e["type"] == "literal_error"}
    numbers = {_key(e) for e in kept if e["type"] != "literal_error"}
    lines = [
        _describe_one(e) + (f" (or {words[_key(e)]})" if _key(e) in words and _key(e) in numbers else "")
        for e in kept
        if not (e["type"] == "literal_error" and _key(e) in numbers)
    ]
    return "; ".join(dict.fromkeys(lines))


def _loc(error: Mapping[str, Any]) -> list[str]:
    """The error's key path without pydantic's union-member tags (``int``, ``tuple[int,int]``, the
    data section's source)."""
    return _walk(error["loc"])[0]


def _walk(loc: Iterable[Any]) -> tuple[list[str], type[BaseModel] | None]:
    """The key path of ``loc`` and the section it ends in (None past a plain value).

    Tags only follow a value's field, never a section's key: a user's key named ``str`` stays. The
    tag after ``data`` names the source whose section the rest of the path is in.
    """
    parts: list[str] = []
    model: type[BaseModel] | None = Config
    members: dict[str, type[BaseModel]] = {}
    for part in loc:
        if str(part) in members:
            model, members = members[str(part)], {}
            continue
        if model is None and _is_union_tag(part):
            continue
        parts.append(str(part))
        field = model.model_fields.get(str(part)) if model is not None else None
        model, members = _section_of(field.annotation if field else None)
    return parts, model


def _section_of(annotation: Any) -> tuple[type[BaseModel] | None, dict[str, type[BaseModel]]]:
    """The section a field holds (a model, or a model or None), or the tagged sections of a
    discriminated union of them (``data``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, {}
    members = [arg for arg in get_args(annotation) if arg is not type(None)]
    if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], BaseModel):
        return members[0], {}
    tagged: dict[str, type[BaseModel]] = {}
    for member in members:
        model, *marks = get_args(member) or (member,)
        tag = next((mark.tag for mark in marks if isinstance(mark, Tag)), None)
        if tag is not None and isinstance(model, type) and issubclass(model, BaseModel):
            tagged[tag] = model
    return None, tagged


def _key(error: Mapping[str, Any]) -> str:
    """The dotted key, printable and short: a key is user input too (a newline, 100k characters)."""
    return _clip(".".join(p if p.isprintable() else repr(p) for p in _loc(error))) or "config"


def _describe_one(error: Mapping[str, Any]) -> str:
    loc, section = _walk(error["loc"][:-1])
    key = _key(error)
    kind = error["type"]
    given = error.get("input")
    if kind in ("union_tag_invalid", "union_tag_not_found") and key == "data":
        name = given.get("name") if isinstance(given, Mapping) else getattr(given, "name", given)
        return unknown_source_message(name)
    if kind == "extra_forbidden":
        if section is not None and issubclass(section, DataConfig) and loc == ["data"]:
            source = str(section.model_fields["name"].default)
            foreign = foreign_key_message(str(error["loc"][-1]), source)
            if foreign is not None:
                return foreign
        hint = _suggest(loc, str(error["loc"][-1]), section)
        return f"unknown key {key}" + (f" — did you mean {hint}?" if hint else "")
    if kind == "missing":
        return f"missing key {key}"
    msg = str(error["msg"]).removeprefix("Value error, ")
    if msg.startswith(f"{key}.") or msg.startswith(f"{key} "):
        return msg  # the message names its keys itself
    shown = "" if isinstance(given, (dict, list, BaseModel)) else f" = {_clip(repr(given))}"
    return f"{key}{shown}: {msg}"


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_union_tag(part: Any) -> bool:
    text = str(part)
    return text in {"int", "float", "str", "bool", "tuple[int,int]", "list[int]"} or text.startswith(
        ("tuple[", "dict[", "list[", "literal[", "constrained-", "function-")
    )


def _suggest(parent: list[str], unknown: str, section: type[BaseModel] | None) -> str | None:
    """The closest valid key of ``section`` (at ``parent``) to an unknown one."""
    if section is None:
        return None
    match = difflib.get_close_matches(unknown, list(section.model_fields), n=1, cutoff=0.6)
    return ".".join([*parent, match[0]]) if match else None


def _deep_copy(data: Mapping[str, Any], depth: int = 0) -> dict[str, Any]:
    if depth > MAX_DEPTH:
        raise ConfigError(f"config: mappings nested deeper than {MAX_DEPTH} levels")
    return {k: _deep_copy(v, depth + 1) if isinstance(v, Mapping) else v for k, v in data.items()}


def to_yaml(config: Config) -> str:
    """The resolved config as YAML, credentials in URIs and secret-named values masked
    (``trainforge.redact``): what config.yaml holds and ``config show`` prints."""
    return yaml.safe_dump(redact_config(config.to_dict()), sort_keys=False)
