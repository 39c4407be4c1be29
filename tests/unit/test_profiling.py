"""``profile``: a 2-rank gloo Session (no Ray) records a trace of the chosen steps on the chosen rank;
the trace opens as Chrome/Perfetto JSON, the summary has the top operators and the communication
share, and the run report shows them."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.runs import tiny_run
from tests.helpers.sessions import train
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.config import load_config
from trainforge.errors import ConfigError
from trainforge.report import write_report
from trainforge.worker.profiling import Interval, fetch_profiles, merged_length, read_summaries


def test_a_profiled_run_writes_a_trace_and_a_summary_for_the_listed_rank_only(tmp_path: Path) -> None:
    store = tmp_path / "store"
    cfg = load_config(
        tiny_run(
            tmp_path,
            run={"name": "prof"},
            train={"max_steps": 8},
            scaling={"num_workers": 2},
            checkpoint={"storage_path": str(store)},
            profile={"steps": [3, 5], "ranks": [1]},
            tracking={"enabled": False},
        )
    )
    outcomes = train(cfg.to_dict(), 2)
    assert [o.final["step"] for o in outcomes] == [8, 8]
    written = store / "prof" / "profile"
    assert sorted(p.name for p in written.iterdir()) == ["rank1.summary.json", "rank1.trace.json"]

    cfg.run_dir.mkdir(parents=True)
    fetched = fetch_profiles(CheckpointStore.for_run(cfg.storage_path, cfg.run.name), cfg.run_dir)
    assert [p.name for p in fetched] == ["rank1.summary.json", "rank1.trace.json"]
    trace = json.loads((cfg.run_dir / "profile" / "rank1.trace.json").read_text())
    assert len(trace["traceEvents"]) > 100
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert {"c10d::allreduce_", "gloo:all_reduce"} <= names  # DDP's gradient all-reduce, over gloo
    (summary,) = read_summaries(cfg.run_dir)
    assert summary["rank"] == 1 and summary["steps"] == [3, 5] and summary["device"] == "cpu"
    assert 0 < summary["comm_share"] < 1
    top = summary["top_operators"]
    assert 5 <= len(top) <= 15 and all(row["calls"] >= 1 for row in top)
    assert top[0]["self_cpu_ms"] >= top[-1]["self_cpu_ms"] > 0

    page = write_report(cfg.run_dir, {"status": "finished", "global_step": 8}).read_text()
    assert "<h2>Profile</h2>" in page and "profile/rank1.trace.json" in page
    assert f"<b>{summary['comm_share'] * 100:.1f}%</b>" in page
    assert all(f'<td class="path">{html.escape(row["name"])}</td>' in page for row in top)


def test_merged_length_counts_nested_and_overlapping_intervals_once() -> None:
    intervals = [Interval(0, 10), Interval(2, 5), Interval(8, 12), Interval(20, 25)]
    assert merged_length(intervals) == 17
    assert merged_length([]) == 0


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        ({"steps": [5, 2]}, r"profile\.steps: \[START, END\] needs START <= END, got \[5, 2\]"),
        ({"steps": [1, 2], "ranks": [2]}, r"profile\.ranks \[2\] are outside the 2 worker\(s\)"),
        ({"steps": [0, 2]}, r"profile\.steps\.0 = 0"),
        ({"steps": [1, 2], "ranks": []}, r"profile\.ranks: List should have at least 1 item"),
    ],
)
def test_bad_profile_values_name_the_key(tmp_path: Path, profile: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(tiny_run(tmp_path, scaling={"num_workers": 2}, profile=profile))
