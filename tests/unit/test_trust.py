"""Untrusted directories: recording a run's git commit never runs what the repository's own config
names (docs/security.md, table 6), and a local Ray listens on loopback unless told otherwise."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from trainforge.config import load_config
from trainforge.errors import ConfigError
from trainforge.tracking.records import git_tags

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

QUICK = {"model": {"name": "mlp"}, "train": {"max_steps": 1}}


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


def hostile_repo(tmp_path: Path) -> tuple[Path, Path]:
    """A repository whose .git/config names a program for every hook point that ``git status``
    could reach (fsmonitor, a clean filter on every file, the post-index-change hook): each program
    creates the marker file. A tracked file is modified afterwards, so status must look at it."""
    repo, marker = tmp_path / "repo", tmp_path / "MARKER"
    repo.mkdir()
    script = tmp_path / "evil.sh"
    script.write_text(f"#!/bin/sh\ntouch {marker}\ncat\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    git(repo, "init", "-q")
    (repo / "train.py").write_text("print(1)\n")
    (repo / ".gitattributes").write_text("* filter=evil\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "init")
    hooks = repo / ".git" / "hooks"
    (hooks / "post-index-change").write_text(f"#!/bin/sh\ntouch {marker}\n")
    (hooks / "post-index-change").chmod(0o755)
    git(repo, "config", "core.fsmonitor", str(script))
    git(repo, "config", "filter.evil.clean", str(script))
    git(repo, "config", "filter.evil.process", str(script))
    (repo / "train.py").write_text("print(2)\n")  # dirty: status compares it, through the filter
    marker.unlink(missing_ok=True)
    return repo, marker


@needs_git
def test_git_tags_of_a_hostile_repository_run_none_of_its_programs(tmp_path: Path) -> None:
    repo, marker = hostile_repo(tmp_path)
    tags = git_tags(repo)
    assert not marker.exists(), "git ran a program named by the repository's config"
    assert tags["mlflow.source.git.commit"] == git(repo, "rev-parse", "HEAD").strip()
    assert tags["trainforge.git_dirty"] == "true"


@needs_git
def test_the_hostile_repository_does_run_its_programs_under_plain_git(tmp_path: Path) -> None:
    """The probe is live: the same repository, under the plain ``git status`` trainforge used to
    run, executes the repository's program."""
    repo, marker = hostile_repo(tmp_path)
    git(repo, "status", "--porcelain", "--untracked-files=no")
    assert marker.exists()


@needs_git
def test_git_tags_of_a_clean_checkout_and_of_no_checkout(tmp_path: Path) -> None:
    repo = tmp_path / "clean"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.txt").write_text("a\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "a")
    assert git_tags(repo)["trainforge.git_dirty"] == "false"
    outside = tmp_path / "plain"
    outside.mkdir()
    assert git_tags(outside) == {} or "mlflow.source.git.commit" in git_tags(outside)  # a parent may be a repo


def test_bound_to_loopback_switches_rays_node_address_lookup_only_while_ray_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray._private import ray_constants, services

    from trainforge.driver.ray_session import CLUSTER_ENV, bound_to

    monkeypatch.delenv(CLUSTER_ENV, raising=False)
    before = ray_constants.ENABLE_RAY_CLUSTER
    with bound_to("127.0.0.1"):
        assert os.environ[CLUSTER_ENV] == "0"  # for the processes ray.init spawns
        assert services.get_node_ip_address() == "127.0.0.1"
        assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
    assert before == ray_constants.ENABLE_RAY_CLUSTER and CLUSTER_ENV not in os.environ
    with bound_to("0.0.0.0"):
        assert before == ray_constants.ENABLE_RAY_CLUSTER and CLUSTER_ENV not in os.environ


def test_cluster_bind_address_defaults_to_loopback_and_takes_only_two_values() -> None:
    assert load_config(QUICK).cluster.bind_address == "127.0.0.1"
    assert load_config(QUICK, ["cluster.bind_address=0.0.0.0"]).cluster.bind_address == "0.0.0.0"
    with pytest.raises(ConfigError, match="bind_address"):
        load_config(QUICK, ["cluster.bind_address=10.0.0.5"])
