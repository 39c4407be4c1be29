"""``trainforge bench switches``: what each per-block switch of the parallel plan costs and saves.

Three pairs, each switch off and on, through :mod:`trainforge.worker.blocks` as the plan applies it:

* activation checkpointing ("none" vs "full") on a Llama-style model with long sequences;
* ``torch.compile`` of every block (off vs on) on the same model;
* channels-last memory format (off vs on) on a CNN.

Every configuration runs in a fresh subprocess, so compile caches, allocator state and the
process's peak RSS of one never leak into another; with ``--repeats R`` each pair runs off, on,
off, on, ... so that a load change on a shared machine hits both settings alike. A step is forward,
backward and an AdamW update on one fixed batch; the figure is the median of every timed step of
every repeat, after warm-up (the first step, which compiles, is reported on its own). Two memory
figures, both honest about what they see:

* ``peak MB``: the most tensor memory live during one extra step above what was live before it
  (parameters, AdamW state), from ``torch.profiler``'s allocation events; activations, gradients
  and temporaries, i.e. what activation checkpointing changes, and nothing the allocator keeps;
* ``RSS MB``: the process's peak resident set above its size right after the model was built;
  it also counts gradients, AdamW state, glibc's retained free memory and, with compile, the
  compiler's own memory.

On a shared machine the step times move with the load; the memory figures do not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from trainforge.bench.checkpoint import worker_threads
from trainforge.bench.machine import cpu_model
from trainforge.consoles import make_console

MB = 1_000_000
SWITCHES = ("activation_checkpointing", "compile", "channels_last")


@dataclass(frozen=True)
class Case:
    """One configuration: a model, its batch, and the switches on for it."""

    switch: str
    on: bool
    model: str
    batch: int
    seq_len: int = 0  # language models
    vocab: int = 0
    image: int = 0  # CNNs: square images of this side
    steps: int = 5
    warmup: int = 2
    threads: int = 1


@dataclass(frozen=True)
class Sample:
    """What one subprocess measured; times in seconds, memory in MB (10^6 bytes)."""

    step_times_s: list[float]
    first_step_s: float
    peak_mb: float
    rss_mb: float


@dataclass(frozen=True)
class Figures:
    """One configuration over its repeats: the median and fastest step, the first step of the first
    repeat (a cold compile), and the largest memory figures."""

    step_s: float
    step_min_s: float
    first_step_s: float
    peak_mb: float
    rss_mb: float
    repeats: int
    step_times_s: list[list[float]]  # every timed step, per repeat, for the JSON report

    @classmethod
    def of(cls, samples: list[Sample]) -> Figures:
        times = [t for sample in samples for t in sample.step_times_s]
        return cls(
            step_s=statistics.median(times),
            step_min_s=min(times),
            first_step_s=samples[0].first_step_s,
            peak_mb=max(sample.peak_mb for sample in samples),
            rss_mb=max(sample.rss_mb for sample in samples),
            repeats=len(samples),
            step_times_s=[sample.step_times_s for sample in samples],
        )


def cases(args: argparse.Namespace) -> list[Case]:
    lm = {"model": args.model, "batch": args.batch, "seq_len": args.seq_len, "vocab": args.vocab}
    cnn = {"model": args.cnn, "batch": args.cnn_batch, "image": args.image}
    timing = {"steps": args.steps, "warmup": args.warmup, "threads": args.threads}
    shapes = {"activation_checkpointing": lm, "compile": lm, "channels_last": cnn}
    return [Case(switch, on, **shapes[switch], **timing) for switch in args.switch for on in (False, True)]


# ---------------------------------------------------------------------------------------------
# In the child process: build, switch, step, measure


def proc_status_mb(key: str) -> float:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1)) * 1024 / MB if match else float("nan")


def profiled_peak_mb(step: Callable[[], None]) -> float:
    """The highest tensor memory allocated and not yet freed during ``step``, from profiler events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals, default=0) / MB


def measure(case: Case) -> Sample:
    from trainforge.config import ModelConfig
    from trainforge.data.spec import DataSpec
    from trainforge.models import build_model, build_task
    from trainforge.worker import blocks

    torch.set_num_threads(case.threads)
    torch.manual_seed(0)
    if case.seq_len:
        spec = DataSpec(kind="tokens", input_shape=(case.seq_len,), vocab_size=case.vocab, seq_len=case.seq_len)
        inputs = torch.randint(0, case.vocab, (case.batch, case.seq_len))
        targets = inputs.roll(-1, dims=1)
    else:
        spec = DataSpec(kind="image", input_shape=(3, case.image, case.image), num_classes=10)
        inputs = torch.randn(case.batch, 3, case.image, case.image)
        targets = torch.randint(0, 10, (case.batch,))
    model = build_model(ModelConfig(name=case.model), spec).train()
    rss_built = proc_status_mb("VmRSS")
    found = blocks.repeated_blocks(model)
    if case.on and case.switch == "activation_checkpointing":
        blocks.apply_activation_checkpointing(found, "full")
    if case.on and case.switch == "channels_last" and blocks.to_channels_last(model):
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    if case.on and case.switch == "compile":
        blocks.compile_blocks(found, model)
    task = build_task(ModelConfig(name=case.model), spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        task.loss(model(inputs), targets).backward()
        optimizer.step()

    times = []
    for _ in range(case.warmup + case.steps):
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    optimizer.zero_grad(set_to_none=True)  # freed before the profiled step, so it sees only its own
    peak = profiled_peak_mb(step)
    return Sample(
        step_times_s=times[case.warmup :],
        first_step_s=times[0],
        peak_mb=peak,
        rss_mb=proc_status_mb("VmHWM") - rss_built,
    )


# ---------------------------------------------------------------------------------------------
# In the parent: one subprocess per case, a table, a JSON report


def run_case(case: Case) -> Sample:
    command = [sys.executable, "-m", "trainforge.bench.switches", "--case", json.dumps(asdict(case))]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = " ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"bench switches: {case.switch} on={case.on} failed (exit {done.returncode}): {tail}")
    return Sample(**json.loads(done.stdout.strip().splitlines()[-1]))


def report_of(results: list[tuple[Case, Figures]]) -> dict[str, Any]:
    rows = [{**asdict(case), **asdict(figures)} for case, figures in results]
    ratios = {}
    for switch in dict.fromkeys(case.switch for case, _ in results):
        off, on = (figures for case, figures in results if case.switch == switch)
        ratios[switch] = {"step_time_on_over_off": on.step_s / off.step_s, "peak_on_over_off": on.peak_mb / off.peak_mb}
    machine = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    return {"machine": machine, "results": rows, "ratios": ratios}


def table_of(results: list[tuple[Case, Figures]]) -> Table:
    table = Table(title="bench switches: median step (forward + backward + AdamW), a process per setting and repeat")
    for column in ("switch", "model, batch", "setting", "step s", "min s", "first s", "peak MB", "RSS MB"):
        table.add_column(column, justify="left" if column in ("switch", "model, batch", "setting") else "right")
    for case, f in results:
        shape = (
            f"{case.batch} x {case.seq_len} tokens" if case.seq_len else f"{case.batch} x 3x{case.image}x{case.image}"
        )
        table.add_row(
            case.switch,
            f"{case.model}, {shape}",
            "on" if case.on else "off",
            f"{f.step_s:.3f}",
            f"{f.step_min_s:.3f}",
            f"{f.first_step_s:.2f}",
            f"{f.peak_mb:.0f}",
            f"{f.rss_mb:.0f}",
        )
    return table


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trainforge bench switches", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama_tiny", help="language model for checkpointing and compile")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--cnn", default="resnet18", help="image model for channels-last")
    parser.add_argument("--image", type=int, default=64, help="side of the square images")
    parser.add_argument("--cnn-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration and repeat")
    parser.add_argument("--repeats", type=int, default=1, help="subprocesses per configuration, off and on alternating")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    parser.add_argument("--threads", type=int, default=worker_threads(), help="torch threads (a worker's default)")
    parser.add_argument("--switch", nargs="+", choices=SWITCHES, default=list(SWITCHES))
    parser.add_argument("--json", action="store_true", help="print the report as JSON after the table")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child process: measure one case, print JSON
    args = parser.parse_args(argv)
    if min(args.steps, args.warmup, args.repeats) < 1:
        parser.error("--steps, --warmup and --repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Run every switch off and on, print the table (and the JSON report with ``--json``), return the report."""
    args = parse_args(argv)
    if args.case:
        print(json.dumps(asdict(measure(Case(**json.loads(args.case))))))
        return None
    console = make_console(stderr=args.json)  # with --json, stdout holds the JSON object alone
    order = cases(args)
    samples: dict[Case, list[Sample]] = {case: [] for case in order}
    for off, on in zip(order[::2], order[1::2], strict=True):
        for repeat in range(args.repeats):
            for case in (off, on):
                setting = "on" if case.on else "off"
                where = f"repeat {repeat + 1}/{args.repeats}"
                console.print(f"  {case.switch} {setting} ({case.model}), {where}", highlight=False)
                samples[case].append(run_case(case))
    results = [(case, Figures.of(samples[case])) for case in order]
    report = report_of(results)
    console.print(table_of(results))
    console.print(
        f"{report['machine']['cpu']}, {report['machine']['cores']} cores, {args.threads} torch thread(s), "
        f"torch {torch.__version__}",
        highlight=False,
    )
    if args.json:
        print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
