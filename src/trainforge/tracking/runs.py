"""Opening, resuming and ending MLflow runs; the calls the background sender makes.

Every function here runs on the sender thread with its client. Calls are idempotent, because a
call that failed half-way is made again from the start: params are diffed against what the run
already holds, tags and artifacts overwrite.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainforge.redact import redact_text
from trainforge.tracking.outbox import Call, OpenedRun
from trainforge.tracking.records import MAX_TAG_VALUE_LENGTH, clip, sanitize_key
from trainforge.tracking.store import artifact_location

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger("trainforge")

PER_REQUEST = 100  # MLflow's limit on params (and tags) per log_batch request
RESUME_FILE = "tracking.json"
STATUS = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED", "aborted": "KILLED"}
PARENT_TAG = "mlflow.parentRunId"
RUN_DIR_TAG = "trainforge.run_dir"
# MLflow 3's UI guesses the kind of an experiment without this tag and may open it in its GenAI
# view (traces, prompts); custom_model_development is its kind for model training (runs, charts).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"


@dataclass(frozen=True)
class RunPlan:
    """Where and how to open a run."""

    uri: str
    experiment: str
    run_name: str
    tags: Mapping[str, str]
    parent_run_id: str | None = None
    resume_file: Path | None = None  # remembers the run id, so a resumed training run continues it
    run_dir: Path | None = None  # tagged on the run as it is created, so that the run can be found by it


def open_run(client: MlflowClient, plan: RunPlan) -> OpenedRun:
    """Continue the run ``plan.resume_file`` names if the store still has it, or the child of the
    parent made for this run directory, else create one."""
    found = reopen(client, plan) or adopt(client, plan)
    if found is not None:
        return found
    if plan.parent_run_id:  # a trial lives in its search's experiment, whatever its own config says
        experiment_id = client.get_run(plan.parent_run_id).info.experiment_id
    else:
        experiment_id = ensure_experiment(client, plan.experiment, plan.uri)
    tags = {**plan.tags, **({PARENT_TAG: plan.parent_run_id} if plan.parent_run_id else {})}
    if plan.run_dir is not None:
        tags[RUN_DIR_TAG] = str(plan.run_dir)
    run = client.create_run(experiment_id, run_name=plan.run_name, tags=tags)
    opened = OpenedRun(run.info.run_id, experiment_id)
    if plan.resume_file is not None:
        remember(plan.resume_file, plan.uri, opened)
    return opened


def adopt(client: MlflowClient, plan: RunPlan) -> OpenedRun | None:
    """The child of ``plan.parent_run_id`` created for ``plan.run_dir`` and never remembered: a
    trial's process that Tune ended between creating its run and writing the resume file. The
    search driver, completing the trial, continues that run rather than starting a second one."""
    value = str(plan.run_dir) if plan.run_dir is not None else ""
    if not plan.parent_run_id or not value or "'" in value:
        return None
    experiment_id = client.get_run(plan.parent_run_id).info.experiment_id
    query = f"tags.`{PARENT_TAG}` = '{plan.parent_run_id}' and tags.`{RUN_DIR_TAG}` = '{value}'"
    runs = client.search_runs([experiment_id], query, max_results=1, order_by=["attributes.start_time ASC"])
    if not runs:
        return None
    client.update_run(runs[0].info.run_id, status="RUNNING")
    opened = OpenedRun(runs[0].info.run_id, experiment_id)
    if plan.resume_file is not None:
        remember(plan.resume_file, plan.uri, opened)
    return opened


def ensure_experiment(client: MlflowClient, name: str, uri: str) -> str:
    """The id of experiment ``name``, created (artifacts next to a local store) if missing, and
    marked as a model-training experiment unless someone already chose its kind."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return str(
                client.create_experiment(
                    name, artifact_location=artifact_location(uri), tags={EXPERIMENT_KIND_TAG: TRAINING_KIND}
                )
            )
        except MlflowException:
            found = client.get_experiment_by_name(name)  # another run created it meanwhile
            if found is None:
                raise
    if found.lifecycle_stage == "deleted":
        raise ValueError(
            f"MLflow experiment {name!r} is deleted; restore it (mlflow experiments restore) "
            "or choose another tracking.experiment"
        )
    if EXPERIMENT_KIND_TAG not in found.tags:  # made by an older trainforge, or by hand
        client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    return str(found.experiment_id)


def reopen(client: MlflowClient, plan: RunPlan) -> OpenedRun | None:
    """The run the resume file names, set back to RUNNING; None when there is none to continue."""
    from mlflow.exceptions import MlflowException

    remembered = read_resume_file(plan.resume_file)
    if remembered is None or remembered.get("uri") != redact_text(plan.uri):
        return None
    try:
        run = client.get_run(str(remembered["run_id"]))
    except MlflowException as err:
        if err.get_http_status_code() >= 500:
            raise  # the store is away: try again later, rather than start a second run
        log.info("MLflow run %s of this run directory is gone (%s); starting a new one", remembered["run_id"], err)
        return None
    if run.info.lifecycle_stage == "deleted":
        log.info("MLflow run %s of this run directory was deleted; starting a new one", run.info.run_id)
        return None
    client.update_run(run.info.run_id, status="RUNNING")
    return OpenedRun(run.info.run_id, run.info.experiment_id)


def read_resume_file(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "run_id" in data else None


def remember(path: Path, uri: str, opened: OpenedRun) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps({"uri": redact_text(uri), "run_id": opened.run_id, "experiment_id": opened.experiment_id})
        )
    except OSError as err:  # the run is tracked; only a later resume would start a new MLflow run
        log.warning("could not write %s: %s", path, err)


def chunks(items: Mapping[str, str]) -> Iterator[list[tuple[str, str]]]:
    pairs = list(items.items())
    for start in range(0, len(pairs), PER_REQUEST):
        yield pairs[start : start + PER_REQUEST]


def params_call(params: Mapping[str, str]) -> Call:
    """Log params; on a continued run, only new keys. MLflow refuses to change a logged param, so
    a value that changed since (a resume with more steps) is recorded as a tag
    ``trainforge.resume_changed.<key>``."""

    def call(client: MlflowClient, run_id: str) -> None:
        from mlflow.entities import Param

        existing = client.get_run(run_id).data.params
        new = {k: v for k, v in params.items() if k not in existing}
        changed = {
            sanitize_key(f"trainforge.resume_changed.{k}"): clip(f"{v} (was {existing[k]})", MAX_TAG_VALUE_LENGTH)
            for k, v in params.items()
            if k in existing and existing[k] != v
        }
        for chunk in chunks(new):
            client.log_batch(run_id, params=[Param(k, v) for k, v in chunk], synchronous=True)
        tags_call(changed)(client, run_id)

    return call


def tags_call(tags: Mapping[str, str]) -> Call:
    def call(client: MlflowClient, run_id: str) -> None:
        from mlflow.entities import RunTag

        for chunk in chunks(tags):
            client.log_batch(run_id, tags=[RunTag(k, v) for k, v in chunk], synchronous=True)

    return call


def artifact_call(path: Path, artifact_path: str | None = None) -> Call:
    """Upload a file, or a directory's content, as it is when the call is made."""

    def call(client: MlflowClient, run_id: str) -> None:
        if path.is_dir():
            client.log_artifacts(run_id, str(path), artifact_path)
        else:
            client.log_artifact(run_id, str(path), artifact_path)

    return call


def end_call(status: str) -> Call:
    """Set the run's final status: FINISHED, FAILED or KILLED (a stopped or aborted run)."""

    def call(client: MlflowClient, run_id: str) -> None:
        client.set_terminated(run_id, STATUS.get(status, "FAILED"))

    return call
