"""The shipped monitoring files: promtool's checks and rule unit tests, one firing and one silent
test per alert, complete annotations with a runbook section, well-formed dashboards."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
RULES = MONITORING / "rules"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (.ci/run installs Debian's)")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=MONITORING, timeout=120)


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load((RULES / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def rule_tests() -> list[dict[str, Any]]:
    return [
        case
        for path in sorted((RULES / "tests").glob("*.yml"))
        for group in yaml.safe_load(path.read_text())["tests"]
        for case in group.get("alert_rule_test", [])
    ]


@needs_promtool
def test_promtool_accepts_the_config_and_rules() -> None:
    checked = promtool("check", "config", "prometheus/prometheus.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "2 rule files found" in checked.stdout
    checked = promtool("check", "rules", *sorted(str(p.relative_to(MONITORING)) for p in RULES.glob("*.yml")))
    assert checked.returncode == 0, checked.stdout + checked.stderr


@needs_promtool
def test_promtool_rule_unit_tests_pass() -> None:
    tests = sorted(str(p.relative_to(MONITORING)) for p in (RULES / "tests").glob("*.yml"))
    assert tests
    result = promtool("test", "rules", *tests)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    names = {rule["alert"] for rule in alerts()}
    cases = rule_tests()
    assert {case["alertname"] for case in cases} <= names  # a typo would make a silent test pass
    fires = {case["alertname"] for case in cases if case.get("exp_alerts")}
    silent = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    assert names - fires == set(), "alerts without a test where they fire"
    assert names - silent == set(), "alerts without a test where they stay silent"


def test_the_issue_s_alert_list_is_covered() -> None:
    names = {rule["alert"] for rule in alerts()}
    for wanted in ("Worker", "Node", "OOM", "Stalled", "Throughput", "Checkpoint", "Communication", "LowGpu", "Temp"):
        assert any(wanted in name for name in names), wanted


def test_alerts_say_how_bad_what_happened_and_where_the_runbook_is() -> None:
    docs = (ROOT / "docs" / "monitoring.md").read_text()
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", docs, flags=re.MULTILINE)}
    for rule in alerts():
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        annotations = rule["annotations"]
        assert annotations.keys() == {"summary", "description", "runbook_url"}, rule["alert"]
        page, _, anchor = annotations["runbook_url"].partition("#")
        assert page == "docs/monitoring.md" and anchor in anchors, rule["alert"]


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_dashboards_are_well_formed_and_read_the_selected_datasource() -> None:
    boards = {p.stem: json.loads(p.read_text()) for p in sorted((MONITORING / "grafana" / "dashboards").glob("*.json"))}
    assert boards.keys() == {"training", "gpu", "cluster"}
    assert len({b["uid"] for b in boards.values()}) == 3
    for name, board in boards.items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource", name
        panels = [p for top in board["panels"] for p in (top, *top.get("panels", []))]
        assert len({p["id"] for p in panels}) == len(panels), name
        graphs = [p for p in panels if p["type"] != "row"]
        assert len(graphs) >= 6, name
        for panel in graphs:
            where = f"{name}: {panel['title']}"
            assert panel["datasource"]["uid"] == "${datasource}", where
            assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"]), where
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, where


def test_grafana_provisioning_points_at_the_dashboards() -> None:
    provisioning = MONITORING / "grafana" / "provisioning"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "trainforge.yml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus"
