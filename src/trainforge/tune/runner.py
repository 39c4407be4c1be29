"""Driver side of a search: Ray session, Tuner assembly (or restore), and the outputs at the end.

Resource accounting: a trial's function is only the Ray Train driver of its run, so Tune reserves
just ``TRIAL_CPU`` for it; the run's workers are placed by Ray Train in a placement group of their
own, sized by the trial's ``ScalingConfig``. Were the workers' resources also reserved in Tune's
placement group for the trial, the worker group could never be scheduled. Concurrency is therefore
capped by ``tune.max_concurrent``, by default what the free resources hold:
``floor(free / (workers_per_trial x resources per worker + TRIAL_CPU))`` over every resource kind.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
from rich.console import Console

from trainforge.checkpoint.format import write_json_atomic
from trainforge.checkpoint.storage import join_uri
from trainforge.config import Config
from trainforge.consoles import make_console
from trainforge.driver.run import preflight, ray_logs_to, ray_session, resolve_address
from trainforge.driver.runlock import acquire, check_writable
from trainforge.driver.warm import shutdown_pool, start_pool
from trainforge.errors import ConfigError
from trainforge.redact import redact_config
from trainforge.tune.placement import Releaser, release, start_ledger
from trainforge.tune.relay import relayed
from trainforge.tune.results import write_outputs
from trainforge.tune.schedulers import SearchSettings, build_scheduler, build_search_alg, make_settings
from trainforge.tune.space import SearchSpace
from trainforge.tune.table import TrialWatch
from trainforge.tune.tracking import start_search_run
from trainforge.tune.trial import TUNE_DIR_PREFIX, TrialSetup, run_trial

TRIAL_CPU = 0.01  # the trial function's own share: it polls its run, the workers do the work
SEARCH_FILE = "search.json"  # what a search was started with; a re-run continues only the same search
AIR_OUTPUT_ENV = "RAY_AIR_NEW_OUTPUT"


def trial_name(trial: Any) -> str:
    return str(trial.trial_id)


def tune_trial_dirname(trial: Any) -> str:
    """Tune's folder for a trial: not the run dir, where Tune's checkpoint_NNNNNN folders would
    pass for trainforge checkpoints."""
    return f"{TUNE_DIR_PREFIX}{trial.trial_id}"


def search_base(config: Config, settings: SearchSettings) -> dict[str, Any]:
    """The config every trial starts from: runs live under the search dir, each trial has
    ``tune.workers_per_trial`` workers, checkpoints go under the search's own storage folder
    (and, under PBT, are taken at every perturbation step)."""
    raw = config.to_dict()
    if settings.checkpoint_every is not None:
        raw["checkpoint"]["every_n_steps"] = settings.checkpoint_every
    raw["run"]["output_dir"] = str(config.run_dir)
    raw["scaling"]["num_workers"] = config.tune.workers_per_trial
    storage = config.checkpoint.storage_path
    if storage:
        raw["checkpoint"]["storage_path"] = join_uri(config.storage_path, config.run.name)
    return raw


def trial_demand(config: Config) -> dict[str, float]:
    """Resources one trial holds while it trains: its workers (as Ray Train counts them) plus its driver."""
    from ray.train.v2.api.config import ScalingConfig

    scaling = config.scaling
    demand = dict(
        ScalingConfig(
            num_workers=config.tune.workers_per_trial,
            use_gpu=scaling.use_gpu,
            resources_per_worker=dict(scaling.resources_per_worker) if scaling.resources_per_worker else None,
        ).total_resources
    )
    demand["CPU"] = demand.get("CPU", 0.0) + TRIAL_CPU
    return {k: v for k, v in demand.items() if v > 0}


def trial_resources() -> dict[str, float]:
    """What Tune reserves for a trial's function: a sliver of CPU, on the driver's node when the
    driver is a node of the cluster (as Ray Train puts a run's controller beside its driver), so
    that every trial's run directory is written on the machine that reads the search's results."""
    here = f"node:{ray.util.get_node_ip_address()}"
    pinned = {here: 0.001} if here in ray.cluster_resources() else {}
    return {"CPU": TRIAL_CPU, **pinned}


def default_concurrency(demand: dict[str, float], available: dict[str, float]) -> int:
    """How many trials the free resources hold at once (at least one: it waits for resources)."""
    fits = [math.floor(available.get(kind, 0.0) / need + 1e-9) for kind, need in demand.items()]
    return max(1, min(fits)) if fits else 1


def search_identity(base: dict[str, Any], space: SearchSpace, settings: SearchSettings) -> dict[str, Any]:
    return {
        "config": redact_config(base),  # written to search.json: no credentials
        "space": {d.key: {d.kind: list(d.args)} for d in space.domains},
        "plan": {k: v for k, v in vars(settings).items()},
    }


def resuming(search_dir: Path, identity: dict[str, Any]) -> bool:
    """Whether this is a re-run of an interrupted (or finished) search: same config and space, and
    Tune has written its state. A different search under the same name is refused."""
    from ray import tune

    recorded_path = search_dir / SEARCH_FILE
    if not (recorded_path.is_file() and tune.Tuner.can_restore(str(search_dir))):
        return False
    recorded = json.loads(recorded_path.read_text())
    if recorded != json.loads(json.dumps(identity)):
        changed = sorted(k for k in identity if recorded.get(k) != json.loads(json.dumps(identity[k])))
        raise ConfigError(
            f"search {search_dir} was started with another {' and '.join(changed)}; re-run it with the same files "
            "to continue it, or set a new run.name to start a new search"
        )
    return True


@contextlib.contextmanager
def quiet_tune() -> Iterator[None]:
    """Tune's own console output off (its experiment box and status tables): the TrialWatch table
    shows the search. RAY_AIR_NEW_OUTPUT=0 selects Tune's classic reporter, which verbose=0 silences."""
    saved = os.environ.get(AIR_OUTPUT_ENV)
    os.environ[AIR_OUTPUT_ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(AIR_OUTPUT_ENV, None)
        else:
            os.environ[AIR_OUTPUT_ENV] = saved


def run_search(
    config: Config,
    space: SearchSpace,
    *,
    address: str | None = None,
    verbose: bool = False,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run (or continue) the search; write tune_summary.json, best.yaml and plots; the summary."""
    shown = console or make_console(stderr=True)
    settings = make_settings(config, space)
    address = resolve_address(config, address)
    preflight(config, local=address is None)
    search_dir = config.run_dir
    check_writable(search_dir, "run.output_dir")
    # One search driver per search directory, as one training driver per run directory: two would
    # rewrite each other's search.json and Tune state. Held until the outputs are written.
    advice = "wait for it to end, or choose another run.name or run.output_dir"
    with acquire(search_dir, what="search directory", advice=advice):
        return _search(config, space, settings, shown, address=address, verbose=verbose)


def _search(
    config: Config, space: SearchSpace, settings: SearchSettings, shown: Console, *, address: str | None, verbose: bool
) -> dict[str, Any]:
    search_dir = config.run_dir
    base = search_base(config, settings)
    identity = search_identity(base, space, settings)
    again = resuming(search_dir, identity)
    write_json_atomic(search_dir / SEARCH_FILE, identity)
    watch = TrialWatch(shown, settings.metric, settings.mode, space.keys)
    started_at = time.time()
    trial_base = copy.deepcopy(base)  # + where the trials' MLflow runs go (not part of the search's identity)
    search_run = start_search_run(config, settings, space, trial_base)
    try:
        grid, setup, concurrency = _run_tuner(
            config, space, settings, trial_base, watch, again, address=address, verbose=verbose, console=shown
        )
    except BaseException:
        search_run.end("failed")
        raise
    return write_outputs(
        config=config,
        space=space,
        settings=settings,
        setup=setup,
        grid=grid,
        watch=watch,
        started_at=started_at,
        wall_time_s=time.time() - started_at,
        concurrency=concurrency,
        console=shown,
        search_run=search_run,
    )


def _run_tuner(
    config: Config,
    space: SearchSpace,
    settings: SearchSettings,
    base: dict[str, Any],
    watch: TrialWatch,
    again: bool,
    *,
    address: str | None,
    verbose: bool,
    console: Console,
) -> tuple[Any, TrialSetup, int]:
    """Ray session, Tuner (new or restored), fit; Tune's results, the trials' setup, the concurrency."""
    search_dir = config.run_dir
    with (
        ray_logs_to(search_dir / "ray.log", verbose=verbose),
        ray_session(config, address, verbose=verbose) as where,
    ):
        ledger = start_ledger()
        pool = start_pool() if config.tune.reuse_workers else None
        setup = TrialSetup(
            base=base,
            metric=settings.metric,
            pbt_every=settings.checkpoint_every,
            workdir=os.getcwd(),
            ledger=ledger,
            pool=pool,
        )
        demand = trial_demand(config)
        concurrency = config.tune.max_concurrent or default_concurrency(demand, ray.available_resources())
        console.print(
            f"[bold]trainforge tune[/] [cyan]{config.run.name}[/] · {'continuing' if again else 'starting'} "
            f"{settings.num_trials} trial(s), {settings.search} search, scheduler {settings.scheduler}, "
            f"metric {settings.metric} ({settings.mode}) · up to {concurrency} at once on {where} "
            f"· output {search_dir}",
            highlight=False,
            soft_wrap=True,
        )
        try:
            with relayed(str(search_dir), watch, Releaser(ledger, pool)) as relay:
                tuner = make_tuner(config, space, settings, setup, relay, concurrency, again)
                with quiet_tune():
                    grid = tuner.fit()
        finally:
            if pool is not None:  # the warm groups' CPUs and placement groups, given back
                shutdown_pool(pool)
        # Every trial's actor has ended: no worker group of the search may hold resources now.
        release(ledger, settle_s=30.0, final=True)
    return grid, setup, concurrency


def make_tuner(
    config: Config,
    space: SearchSpace,
    settings: SearchSettings,
    setup: TrialSetup,
    relay: Any,
    concurrency: int,
    again: bool,
) -> Any:
    from ray import tune

    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), trial_resources())
    param_space = space.param_space(enumerate_grid=settings.enumerate_grid)
    search_dir = config.run_dir
    if again:
        return tune.Tuner.restore(
            str(search_dir), trainable, param_space=param_space, resume_unfinished=True, resume_errored=True
        )
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=settings.metric,
            mode=settings.mode,
            search_alg=build_search_alg(settings, concurrency),
            scheduler=build_scheduler(settings, space),
            num_samples=settings.num_samples,
            time_budget_s=config.tune.time_budget_s,
            trial_name_creator=trial_name,
            trial_dirname_creator=tune_trial_dirname,
        ),
        run_config=tune.RunConfig(
            name=search_dir.name,
            storage_path=str(search_dir.parent),
            callbacks=[relay],
            verbose=0,
            # A trial's worker failures are Ray Train's to retry (failure.max_failures); a trial
            # whose training failed for good is not run again.
            failure_config=tune.FailureConfig(max_failures=0),
            # PBT hands these to other trials; a few are kept so a pending exploit still finds its donor.
            checkpoint_config=tune.CheckpointConfig(num_to_keep=3),
        ),
    )
