"""Where runs are tracked and how the driver talks to it: the store URI, the client, MLflow's logs.

The default store is ``sqlite:///<run.output_dir>/mlflow.db`` with artifacts in
``<run.output_dir>/mlartifacts``: no server is needed, every run of that directory lands in one
store, and ``mlflow ui --backend-store-uri sqlite:///...`` opens it. MLflow 3 refuses its old
file store (``./mlruns``) unless ``MLFLOW_ALLOW_FILE_STORE`` is set, so sqlite is the local choice;
creating a new database runs MLflow's schema migrations (1-2 s of CPU), so a new store starts
as a copy of an empty database those migrations made once per MLflow version, kept in
``~/.cache/trainforge`` (``seed_store``).
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from trainforge.errors import ConfigError, TrainforgeError
from trainforge.redact import redacting

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger("trainforge")

DB_FILE = "mlflow.db"
ARTIFACTS_DIR = "mlartifacts"
SENDER_THREAD = "trainforge-mlflow"

# MLflow's defaults (7 retries, 120 s timeout) make one call to a dead server cost minutes; the
# background sender retries on its own schedule, so each call should fail in seconds.
HTTP_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}

# Loggers MLflow points at stderr on import (mlflow.utils.logging_utils); they go to the run's log.
MLFLOW_LOGGERS = ("mlflow", "sqlalchemy.engine", "alembic", "huey")


class TrackingError(TrainforgeError):
    """The tracking store cannot be used and ``tracking.required`` is true."""


def resolve_uri(uri: str | None, output_dir: str | os.PathLike[str]) -> str:
    """``tracking.uri``, else ``MLFLOW_TRACKING_URI``, else the sqlite store under ``output_dir``."""
    chosen = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not chosen:
        return local_store_uri(Path(output_dir).expanduser().resolve())
    scheme = urlparse(chosen).scheme
    if scheme in {"", "file"} and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in {"1", "true"}:
        raise ConfigError(
            f"tracking.uri {chosen!r} is MLflow's file store, which MLflow 3 refuses; use sqlite:///PATH/mlflow.db, "
            "an http(s):// tracking server, or leave tracking.uri unset for the local store"
        )
    return chosen


def local_store_uri(directory: Path) -> str:
    return f"sqlite:///{directory / DB_FILE}"


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, None for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(unquote(uri[len("sqlite:///") :])).expanduser()


def artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: next to a sqlite database (MLflow's own default
    is ./mlruns under whatever the working directory is); a server decides for itself."""
    db = sqlite_path(uri)
    return (db.resolve().parent / ARTIFACTS_DIR).as_uri() if db is not None else None


def is_server(uri: str) -> bool:
    return urlparse(uri).scheme in {"http", "https"}


def run_link(uri: str, experiment_id: str, run_id: str) -> str:
    """One line telling the user where to look at the run."""
    if is_server(uri):
        return f"MLflow run: {uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"MLflow run {run_id}; to browse it: mlflow ui --backend-store-uri {uri}"


def connect(uri: str) -> MlflowClient:
    """A client for ``uri``, with short HTTP retries and MLflow's console logging rerouted.

    Imports MLflow (seconds), so it runs on the sender thread, never on the driver's main loop.
    """
    for name, value in HTTP_ENV.items():
        os.environ.setdefault(name, value)
    db = sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    from mlflow import MlflowClient

    quiet_mlflow()
    if db is not None and not db.exists():
        seed_store(db)
    return MlflowClient(tracking_uri=uri)


def seed_store(db: Path) -> None:
    """Start a new sqlite store as a copy of an empty, migrated one (made once per MLflow version).

    MLflow creates the default experiment on opening it, with this store's artifact root. Any
    failure (no writable cache, no hard links, a store made meanwhile) leaves the store to MLflow.
    """
    try:
        empty = empty_store()
        copy = db.with_name(f".{db.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            shutil.copyfile(empty, copy)  # the mode a new file gets (umask), as MLflow's own
            os.link(copy, db)  # never over a store another process made meanwhile
        finally:
            copy.unlink(missing_ok=True)
    except Exception as err:  # an optimisation only: MLflow makes the store as it always did
        log.debug("new MLflow store %s made by MLflow (%s)", db, err)


def empty_store() -> Path:
    """An empty MLflow database at this MLflow version's schema, under the user's cache; made once
    (atomically, so concurrent runs never see half of one)."""
    import mlflow
    from mlflow import MlflowClient

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainforge"
    empty = cache / f"mlflow-{mlflow.__version__}-empty.db"
    if empty.exists():
        return empty
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        made = Path(scratch) / DB_FILE
        MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments(max_results=1)
        with sqlite3.connect(made) as con:  # the default experiment is made per store, not copied
            con.execute("DELETE FROM experiments WHERE experiment_id = 0")
        con.close()
        os.replace(made, empty)
    return empty


class _MlflowLogs:
    """One handler per process for MLflow's own loggers and the HTTP retry warnings of the
    sender threads; pointed at the current run's ``tracking.log`` (or nowhere)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.handler: logging.Handler = logging.NullHandler()

    def route_to(self, path: Path | None) -> logging.Handler:
        with self.lock:
            if path is None:
                self.handler = logging.NullHandler()
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                handler = redacting(logging.FileHandler(path))
                handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
                self.handler = handler
            quiet_mlflow()
            return self.handler

    def release(self, handler: logging.Handler) -> None:
        with self.lock:
            if handler is self.handler:
                self.handler = logging.NullHandler()
                quiet_mlflow()
        handler.close()

    def emit(self, record: logging.LogRecord) -> None:
        self.handler.handle(record)


MLFLOW_LOGS = _MlflowLogs()


class _SenderRetriesFilter(logging.Filter):
    """urllib3's "Retrying ..." warnings from a sender thread go to the run's log, not the console."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.threadName and record.threadName.startswith(SENDER_THREAD):
            MLFLOW_LOGS.emit(record)
            return False
        return True


_RETRIES_FILTER = _SenderRetriesFilter()


def quiet_mlflow() -> None:
    """Point MLflow's loggers at the run's log (MLflow resets them to stderr when imported)."""
    for name in MLFLOW_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [MLFLOW_LOGS.handler]
        logger.propagate = False
    urllib3 = logging.getLogger("urllib3.connectionpool")
    if _RETRIES_FILTER not in urllib3.filters:
        urllib3.addFilter(_RETRIES_FILTER)


def probe(uri: str) -> None:
    """Fail now, in one line, when the store at ``uri`` cannot be used (``tracking.required``)."""
    try:
        connect(uri).search_experiments(max_results=1)
    except Exception as err:
        raise TrackingError(
            f"tracking.uri {uri} cannot be reached ({first_line(err)}); start the server, fix tracking.uri, "
            "or set tracking.required: false to train without it"
        ) from None


def first_line(err: BaseException, limit: int = 300) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:limit]
