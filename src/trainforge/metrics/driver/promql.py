"""Which metric names the shipped dashboards and rules read (deploy/monitoring/).

A dashboard panel or an alert over a misspelt or renamed metric shows an empty graph or never
fires, silently. The Prometheus test (tests/integration/test_prometheus.py) collects every PromQL
expression here and checks each metric name it references against what a real run exported.

``referenced_names`` is a small lexer, not a parser: it drops strings, label matchers, ranges and
durations, then keeps the identifiers that are neither functions, aggregations, keywords nor
label lists (``by (...)``, ``on (...)``, ...). That is all it takes to find the metric names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
OPERATOR_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}
AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
}
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
NAME_MATCHER = re.compile(r'__name__\s*=\s*"([^"]+)"')
TOKEN = re.compile(
    r"(?P<duration>(?:\d+(?:ms|[smhdwy]))+)"
    r"|(?P<number>0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)"
    r"|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)"
    r"|(?P<other>\S)"
)
GRAFANA_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$", re.DOTALL)


def referenced_names(expr: str) -> set[str]:
    """Metric names an expression selects (recording-rule names included)."""
    names = set(NAME_MATCHER.findall(expr))
    text = STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    tokens = [(m.lastgroup, m.group()) for m in TOKEN.finditer(text)]
    index = 0
    while index < len(tokens):
        kind, value = tokens[index]
        following = tokens[index + 1][1] if index + 1 < len(tokens) else ""
        if kind == "ident":
            lowered = value.lower()
            if lowered in LABEL_LIST_KEYWORDS:
                if following == "(":
                    index = _closing(tokens, index + 1)
            elif following == "(" or lowered in AGGREGATIONS or lowered in OPERATOR_KEYWORDS:
                pass  # a function call or an aggregation (its "by (...)" comes next)
            else:
                names.add(value)
        index += 1
    return names


def _closing(tokens: list[tuple[str | None, str]], opening: int) -> int:
    depth = 0
    for index in range(opening, len(tokens)):
        depth += {"(": 1, ")": -1}.get(tokens[index][1], 0)
        if depth == 0:
            return index
    return len(tokens)


@dataclass(frozen=True)
class Expression:
    source: str  # file and panel or rule, for messages
    expr: str
    records: str | None = None  # the name a recording rule stores its result under


def rule_expressions(path: Path) -> Iterator[Expression]:
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            name = rule.get("record") or rule.get("alert")
            yield Expression(f"{path.name}: {name}", str(rule["expr"]), rule.get("record"))


def dashboard_expressions(path: Path) -> Iterator[Expression]:
    """Panel queries and Prometheus-backed template variables (``label_values(selector, label)``)."""
    dashboard = json.loads(path.read_text())
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield Expression(f"{path.name}: {panel.get('title')}", target["expr"])
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else str(query or "")
        match = GRAFANA_LABEL_VALUES.match(query)
        yield Expression(f"{path.name}: variable {variable.get('name')}", match.group(1) if match else query)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows hold their panels


def deploy_expressions(monitoring: Path) -> list[Expression]:
    """Every expression under deploy/monitoring: rules, then dashboards."""
    found: list[Expression] = []
    for path in sorted((monitoring / "rules").glob("*.yml")):
        found.extend(rule_expressions(path))
    for path in sorted((monitoring / "grafana" / "dashboards").glob("*.json")):
        found.extend(dashboard_expressions(path))
    return found


def unresolved_names(expressions: list[Expression], available: set[str]) -> dict[str, set[str]]:
    """Names each expression reads that are neither ``available`` nor recorded by a rule whose own
    inputs resolve; keyed by the expression's source. Empty when everything resolves."""
    recorded = {e.records: e for e in expressions if e.records}
    resolved = set(available)
    changed = True
    while changed:  # recording rules may read other recording rules
        changed = False
        for name, rule in recorded.items():
            if name not in resolved and referenced_names(rule.expr) <= resolved:
                resolved.add(name)
                changed = True
    missing = {e.source: referenced_names(e.expr) - resolved for e in expressions}
    return {source: names for source, names in missing.items() if names}
