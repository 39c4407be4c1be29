"""A submitted run's secrets travel in the job's environment, never in the files it uploads.

``trainforge submit`` writes the resolved config into the working directory that Ray packs,
keeps in its object store and unpacks on the head, where other users may read it. So that file
holds what ``config show`` prints (``redact_config``: every credential masked), and each value
that was masked travels whole in the job's environment (Ray's ``runtime_env`` ``env_vars``) as
``TRAINFORGE_SUBMIT_SECRETS``: a JSON list of ``[path, value]``, a path being the keys and list
indices that lead to the value. The job's ``trainforge train`` puts them back before the config is
validated. Who can still read a job's environment: docs/security.md ("The submit path").
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainforge.config.loading import read_yaml
from trainforge.errors import ConfigError
from trainforge.redact import redact_config

SECRETS_ENV = "TRAINFORGE_SUBMIT_SECRETS"

Secret = tuple[list[str | int], Any]  # (the keys and list indices leading to the value, the value)


def split_secrets(tree: dict[str, Any]) -> tuple[dict[str, Any], list[Secret]]:
    """``tree`` (a config dump) masked as every record of a run is, and the real values it masked."""
    public = redact_config(tree)
    return public, list(_differences(tree, public, []))


def _differences(real: Any, shown: Any, path: list[str | int]) -> Iterator[Secret]:
    if isinstance(real, Mapping):
        for key, value in real.items():
            yield from _differences(value, shown[key], [*path, key])
    elif isinstance(real, (list, tuple)):
        for index, item in enumerate(real):
            yield from _differences(item, shown[index], [*path, index])
    elif real != shown:
        yield path, real


def secrets_env(secrets: list[Secret]) -> dict[str, str]:
    """The job's environment variables that carry ``secrets`` (none when there are none)."""
    return {SECRETS_ENV: json.dumps([[path, value] for path, value in secrets])} if secrets else {}


def submitted_source(path: str) -> str | dict[str, Any]:
    """What ``trainforge train`` loads: the config file at ``path`` as it is, or, in a job that
    ``trainforge submit`` started (``TRAINFORGE_SUBMIT_SECRETS`` set), its sections with the
    secrets put back."""
    text = os.environ.get(SECRETS_ENV)
    if text is None:
        return path
    return with_secrets(read_yaml(Path(path)), text)


def with_secrets(raw: dict[str, Any], text: str) -> dict[str, Any]:
    """``raw`` with each ``[path, value]`` of ``text`` (``TRAINFORGE_SUBMIT_SECRETS``) in place."""
    try:
        pairs = [(list(path), value) for path, value in json.loads(text)]
    except (ValueError, TypeError) as err:
        raise ConfigError(
            f"{SECRETS_ENV} is not a list of [path, value] as trainforge submit sets it ({err})"
        ) from None
    for path, value in pairs:
        if not _put(raw, path, value):
            where = ".".join(str(step) for step in path)
            raise ConfigError(
                f"{SECRETS_ENV} has a value for {where}, which the config file does not hold: "
                "the job's config is not the one trainforge submit wrote"
            )
    return raw


def _put(tree: Any, path: list[Any], value: Any) -> bool:
    """Replace the value at ``path`` in ``tree``; False when there is none (a secret only ever
    replaces the masked value that is there)."""
    if not path:
        return False
    node = tree
    for step in path:
        parent = node
        if not _holds(node, step):
            return False
        node = node[step]
    parent[path[-1]] = value
    return True


def _holds(node: Any, step: Any) -> bool:
    if isinstance(node, dict):
        return step in node
    return isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node)
