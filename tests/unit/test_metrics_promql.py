"""The metric-name lexer the Prometheus test relies on: if it missed names, that test would pass
over misspelt metrics; if it invented names, it would fail on keywords."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainforge.metrics.driver.promql import Expression, dashboard_expressions, referenced_names, unresolved_names


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("up", {"up"}),
        ('up{job="ray"} == 0', {"up"}),
        ("sum by (run, trial) (increase(trainforge_restarts[15m])) > 0", {"trainforge_restarts"}),
        ("time() - max without (rank) (a_seconds)", {"a_seconds"}),
        ("a / on (x, y) group_left (z) b > 1e3", {"a", "b"}),
        ("a / ignoring (rank) group_right b", {"a", "b"}),
        ("x offset 5m unless y offset -1h30m", {"x", "y"}),
        ("x > bool 0.5 and y or z", {"x", "y", "z"}),
        ("quantile_over_time(0.5, trainforge:samples_per_second:run[1h])", {"trainforge:samples_per_second:run"}),
        ("max_over_time(sum by (s) (ray_cluster_active_nodes)[15m:1m])", {"ray_cluster_active_nodes"}),
        ('topk(3, count_values("v", build_info))', {"build_info"}),
        ('{__name__="renamed_metric", job="x"}', {"renamed_metric"}),
        ('label_replace(a, "dst", "$1", "src", "(.*)")', {"a"}),
        ('rate(x_total{path=~"/api/(v1|v2)"}[$__rate_interval])', {"x_total"}),
        ("sum(x) by (le)", {"x"}),
        ("vector(0) or absent(m)", {"m"}),
        ("0x1F + .5 + 1.5e-3", set()),
    ],
)
def test_referenced_names(expr: str, expected: set[str]) -> None:
    assert referenced_names(expr) == expected


def test_recording_rules_resolve_through_their_inputs() -> None:
    expressions = [
        Expression("rules: a:rate", "rate(a_total[1m])", records="a:rate"),
        Expression("rules: a:rate:max", "max(a:rate)", records="a:rate:max"),
        Expression("rules: b:rate", "rate(b_total[1m])", records="b:rate"),
        Expression("alerts: A", "a:rate:max > 1"),
        Expression("alerts: B", "b:rate > 1 or c"),
    ]
    assert unresolved_names(expressions, {"a_total", "c"}) == {"rules: b:rate": {"b_total"}, "alerts: B": {"b:rate"}}
    assert unresolved_names(expressions, {"a_total", "b_total", "c"}) == {}


def test_dashboard_expressions_include_collapsed_rows_and_variables(tmp_path: Path) -> None:
    board = {
        "panels": [
            {"type": "timeseries", "title": "p", "targets": [{"expr": "a"}, {"expr": ""}]},
            {"type": "row", "title": "r", "panels": [{"title": "inner", "targets": [{"expr": "b"}]}]},
        ],
        "templating": {
            "list": [
                {"type": "datasource", "name": "datasource", "query": "prometheus"},
                {"type": "query", "name": "run", "query": {"query": 'label_values(c{job="x"}, run)'}},
                {"type": "query", "name": "node", "query": "label_values(d, node)"},
            ]
        },
    }
    path = tmp_path / "board.json"
    path.write_text(json.dumps(board))
    found = [(e.source, e.expr) for e in dashboard_expressions(path)]
    assert found == [
        ("board.json: p", "a"),
        ("board.json: inner", "b"),
        ("board.json: variable run", 'c{job="x"}'),
        ("board.json: variable node", "d"),
    ]
