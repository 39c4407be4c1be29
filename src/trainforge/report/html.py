"""The report page: one self-contained HTML file (inline CSS, images as data URIs, no scripts).

It opens offline, survives being mailed or attached to a ticket, and loads nothing from the
network. Every value that comes from the run is escaped.
"""

from __future__ import annotations

import base64
import datetime
import math
from html import escape
from typing import Any

from trainforge.report.data import EventRow, RunData, finite, step_of
from trainforge.report.extras import card, cost_section, profile_section
from trainforge.report.plots import Plot

STYLE = """
body { font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: #1d2125; background: #f6f7f9; margin: 0; }
main { max-width: 1040px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 32px 0 10px; border-bottom: 1px solid #dde1e6; padding-bottom: 4px; }
.sub { color: #5f6b76; margin: 0 0 16px; word-break: break-all; }
.badge { display: inline-block; padding: 2px 10px; border-radius: 10px; font-size: 13px; font-weight: 600;
         vertical-align: middle; margin-left: 8px; color: #fff; background: #6c757d; }
.badge.finished { background: #2b8a3e; } .badge.failed, .badge.aborted { background: #c92a2a; }
.badge.stopped { background: #e67700; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr)); gap: 10px; }
.card { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 10px 12px; }
.card .k { color: #5f6b76; font-size: 12px; text-transform: uppercase; letter-spacing: .03em; }
.card .v { font-size: 20px; font-weight: 600; margin-top: 2px; }
.card .n { color: #5f6b76; font-size: 12px; margin-top: 2px; }
.error { background: #fff5f5; border: 1px solid #ffc9c9; color: #a51111; border-radius: 6px;
         padding: 10px 12px; margin-top: 12px; white-space: pre-wrap; word-break: break-word; }
table { border-collapse: collapse; background: #fff; border: 1px solid #dde1e6; width: 100%; }
th, td { text-align: left; padding: 5px 10px; border-bottom: 1px solid #eef0f2; vertical-align: top; }
th { background: #f1f3f5; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.path { word-break: break-all; font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
          font-size: 12.5px; }
.metrics { display: grid; grid-template-columns: repeat(auto-fill, minmax(320px, 1fr)); gap: 12px; align-items: start; }
figure { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; margin: 0 0 14px; padding: 8px; }
figure img { width: 100%; height: auto; display: block; }
figcaption { color: #5f6b76; font-size: 13px; margin: 4px 4px 0; }
tr.failure td { color: #a51111; } tr.resume td { color: #a35200; }
pre { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 12px; overflow-x: auto;
      font: 12.5px/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.muted { color: #5f6b76; }
footer { color: #8a949e; font-size: 12px; margin-top: 36px; }
"""

METRIC_GROUPS = (
    ("val/", "Validation"),
    ("train/", "Training"),
    ("perf/", "Performance"),
    ("checkpoint/", "Checkpoint"),
)


def render_page(data: RunData, plots: list[Plot]) -> str:
    """The whole page as one string."""
    summary = data.summary
    status = str(summary.get("status", "unknown"))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(data.name)} · trainforge run report</title>",
        f"<style>{STYLE}</style></head><body><main>",
        f'<h1>{escape(data.name)}<span class="badge {escape(status)}">{escape(status)}</span></h1>',
        f'<p class="sub">{escape(str(data.run_dir))}</p>',
        summary_section(data),
        metrics_section(data),
        cost_section(data),
        plots_section(data, plots),
        profile_section(data.run_dir),
        events_section(data.events, data.skipped_lines),
        config_section(data.config_text),
        f"<footer>Written by <code>trainforge report</code> on {now()} from metrics.jsonl, summary.json "
        "and config.yaml in the run directory.</footer>",
        "</main></body></html>",
    ]
    return "\n".join(parts) + "\n"


def summary_section(data: RunData) -> str:
    summary = data.summary
    last = data.reports[-1] if data.reports else {}
    if not summary:
        note = "no summary.json: the run is still going, or its driver was stopped before writing it"
        cards = [card("Status", "unknown", note)]
    else:
        cards = []
    steps = _int(_pick(summary.get("global_step"), last.get("step")))
    total = _int(last.get("total_steps"))
    cards.append(card("Steps", _fmt_int(steps), f"of {_fmt_int(total)} planned" if total is not None else ""))
    cards.append(card("Epochs", _fmt_int(_int(_pick(summary.get("epoch"), last.get("epoch"))))))
    cards.append(card("Workers", _fmt_int(_int(_pick(summary.get("num_workers"), last.get("world_size"))))))
    cards.append(_restarts_card(data))
    throughput = finite(_pick(summary.get("throughput_samples_per_s"), last.get("perf/steady_samples_per_s")))
    samples = _int(last.get("samples_seen"))
    cards.append(
        card(
            "Throughput",
            f"{throughput:,.0f}/s" if throughput is not None else "–",
            "samples per second, steady" + (f"; {samples:,} samples seen" if samples is not None else ""),
        )
    )
    wall = finite(summary.get("wall_time_s"))
    cards.append(card("Wall time", _duration(wall) if wall is not None else "–", "driver start to end"))
    html = f'<h2>Summary</h2><div class="cards">{"".join(cards)}</div>'
    checkpoint = summary.get("checkpoint") or last.get("checkpoint/path")
    rows = [("Last valid checkpoint", str(checkpoint) if checkpoint else "none")]
    if summary.get("error"):
        html += f'<div class="error"><b>Error:</b> {escape(str(summary["error"]))}</div>'
    html += "<p></p><table>" + "".join(f'<tr><th>{k}</th><td class="path">{escape(v)}</td></tr>' for k, v in rows)
    return html + "</table>"


def _pick(from_summary: Any, from_last_report: Any) -> Any:
    """The summary's figure, or the last report's where the summary has none (a failed or unfinished run)."""
    return from_summary if finite(from_summary) or from_last_report is None else from_last_report


def _restarts_card(data: RunData) -> str:
    summary = data.summary
    failures = sum(1 for marker in data.markers if marker.kind == "failure")
    restarts = _int(summary.get("restarts"))
    count = restarts if restarts is not None else failures
    recovery = [v for v in summary.get("recovery_s", []) or [] if finite(v) is not None]
    note = "recovered in " + ", ".join(f"{float(v):.1f} s" for v in recovery) if recovery else ""
    if not note and count:
        note = "recovery time not measured"
    resumes = sum(1 for marker in data.markers if marker.kind == "resume")
    if resumes and not count:
        note = f"resumed {resumes}× from a checkpoint"
    return card("Restarts", _fmt_int(count), note)


def metrics_section(data: RunData) -> str:
    summary = data.summary
    final = summary.get("final_metrics")
    if not isinstance(final, dict) or not final:
        if data.reports:
            why = f"the run's last report is at step {step_of(data.reports[-1], 0):,}; see the plots"
        elif summary.get("status") == "failed":
            why = "the run failed before its first report"
        else:
            why = "the run has no reports yet"
        return f'<h2>Final metrics</h2><p class="muted">No final metrics: {why}.</p>'
    groups: dict[str, list[tuple[str, Any]]] = {}
    for key in sorted(final):
        title = next((name for prefix, name in METRIC_GROUPS if key.startswith(prefix)), "Other")
        groups.setdefault(title, []).append((key, final[key]))
    order = [name for _, name in METRIC_GROUPS] + ["Other"]
    tables = []
    for title in order:
        if title not in groups:
            continue
        rows = "".join(
            f'<tr><td>{escape(key)}</td><td class="num">{escape(format_metric(key, value))}</td></tr>'
            for key, value in groups[title]
        )
        tables.append(f'<table><tr><th colspan="2">{title}</th></tr>{rows}</table>')
    return f'<h2>Final metrics</h2><div class="metrics">{"".join(tables)}</div>'


def format_metric(key: str, value: Any) -> str:
    """A metric as a person reads it: accuracies also in percent, times with units, 4 significant digits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if key == "time/unix":
        return datetime.datetime.fromtimestamp(value).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    rate = rate_unit(key)
    if rate is not None:
        return f"{value:,.1f} {rate}" if abs(value) >= 100 else f"{value:.3g} {rate}"
    if key.endswith("_s"):
        return _duration(float(value))
    if key.endswith("accuracy"):
        return f"{value:.4f} ({value * 100:.2f} %)"
    if isinstance(value, int) or (float(value).is_integer() and abs(value) >= 1):
        return f"{int(value):,}"
    return f"{value:.4g}"


# What a trailing "_s" divides when it means "per second": ``samples_per_s``, ``net_recv_mb_s``.
# After any other word it is a duration (``perf/step_time_s``, ``checkpoint/stall_s``).
RATE_UNITS = {"per": "/s", "b": "B/s", "bytes": "B/s", "kb": "kB/s", "mb": "MB/s", "gb": "GB/s"}


def rate_unit(key: str) -> str | None:
    """The unit of a per-second metric (``/s``, ``MB/s``, ...), or None when ``key`` is not a rate."""
    name = key.rsplit("/", 1)[-1].lower()
    if key.lower().endswith("/s"):  # "samples/s"
        return "/s"
    words = name.split("_")
    if len(words) >= 2 and words[-1] == "s":
        return RATE_UNITS.get(words[-2])
    return None


def plots_section(data: RunData, plots: list[Plot]) -> str:
    if not plots:
        return '<h2>Plots</h2><p class="muted">No plots: the run has no reports in metrics.jsonl.</p>'
    note = ""
    if data.markers:
        note = (
            '<p class="muted">Vertical lines: worker failures (solid red) and resumes from a checkpoint '
            "(dashed orange). Faded dotted curves are steps that ran and were then lost to a restart.</p>"
        )
    return "<h2>Plots</h2>" + note + figures_html(plots)


def figures_html(plots: list[Plot]) -> str:
    """Each plot as a figure with its caption, the PNG inline (a data URI)."""
    figures = []
    for plot in plots:
        encoded = base64.b64encode(plot.path.read_bytes()).decode("ascii")
        figures.append(
            f'<figure><img alt="{escape(plot.title)}" src="data:image/png;base64,{encoded}">'
            f"<figcaption>{escape(plot.caption)}</figcaption></figure>"
        )
    return "".join(figures)


def events_section(events: list[EventRow], skipped_lines: int) -> str:
    rows = "".join(
        f'<tr class="{escape(e.kind)}"><td class="num">{e.step:,}</td><td>{escape(e.text)}</td></tr>' for e in events
    )
    body = f"<table><tr><th>step</th><th>event</th></tr>{rows}</table>" if events else '<p class="muted">None.</p>'
    if skipped_lines:
        body += f'<p class="muted">{skipped_lines} unreadable line(s) in metrics.jsonl were skipped.</p>'
    return "<h2>Events</h2>" + body


def config_section(config_text: str) -> str:
    if not config_text.strip():
        return '<h2>Resolved config</h2><p class="muted">No config.yaml in the run directory.</p>'
    return f"<h2>Resolved config</h2><pre>{escape(config_text)}</pre>"


def _int(value: Any) -> int | None:
    number = finite(value)
    return int(number) if number is not None else None


def _fmt_int(value: int | None) -> str:
    return f"{value:,}" if value is not None else "–"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 120:
        return f"{minutes} min {rest} s"
    return f"{minutes // 60} h {minutes % 60} min"


def now() -> str:
    return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
