"""Report sections of features a run may have switched on: its cost (``cost``) and its profile
(``profile``). Each is empty when the run did not use the feature."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from trainforge.report.data import RunData, finite
from trainforge.worker.profiling import PROFILE_DIR, read_summaries, trace_name


def cost_section(data: RunData) -> str:
    """summary.json's ``cost`` (or, for a run still going, its last report's figures)."""
    cost = data.summary.get("cost")
    last = data.reports[-1] if data.reports else {}
    if not isinstance(cost, dict):
        if finite(last.get("cost/so_far")) is None:
            return ""
        cost = {
            "so_far": last["cost/so_far"],
            "projected_total": last.get("cost/projected_total"),
            "currency": last.get("cost/currency", ""),
        }
    currency = str(cost.get("currency", ""))
    cards = [card("Cost so far", _money(cost.get("so_far"), currency), "wall time of every driver session")]
    cards.append(card("Projected total", _money(cost.get("projected_total"), currency), "at this session's pace"))
    for key, title, price in (
        ("gpu_hours", "GPU hours", "price_per_gpu_hour"),
        ("cpu_hours", "CPU hours", "price_per_cpu_hour"),
    ):
        hours, rate = finite(cost.get(key)), finite(cost.get(price))
        if hours is not None and rate is not None:
            cards.append(card(title, f"{hours:,.4g}", f"at {rate:,.4g} {currency}/h"))
    return f'<h2>Cost</h2><div class="cards">{"".join(cards)}</div>'


def profile_section(run_dir: Path) -> str:
    """Per profiled rank: the communication share and the top operators by self time."""
    summaries = read_summaries(run_dir)
    if not summaries:
        return ""
    parts = ["<h2>Profile</h2>"]
    for summary in summaries:
        rank = int(summary.get("rank", 0))
        steps = summary.get("steps", ["?", "?"])
        share = finite(summary.get("comm_share"))
        wall = finite(summary.get("wall_ms"))
        parts.append(
            f"<p>Rank {rank}, steps {escape(str(steps[0]))}–{escape(str(steps[-1]))}"
            + (f" ({wall:,.1f} ms)" if wall is not None else "")
            + ": communication share "
            + (f"<b>{share * 100:.1f}%</b>" if share is not None else "–")
            + " (time with a collective in flight over the profiled time). Trace: "
            + f"<code>{escape(f'{PROFILE_DIR}/{trace_name(rank)}')}</code> (open in ui.perfetto.dev).</p>"
        )
        rows = [
            "<tr><th>operator</th><th>calls</th><th>self CPU ms</th><th>self CUDA ms</th><th>CPU total ms</th></tr>"
        ]
        for op in summary.get("top_operators", []):
            if not isinstance(op, dict):
                continue
            cells = "".join(
                f'<td class="num">{_number(op.get(key))}</td>'
                for key in ("calls", "self_cpu_ms", "self_cuda_ms", "cpu_total_ms")
            )
            rows.append(f'<tr><td class="path">{escape(str(op.get("name", "")))}</td>{cells}</tr>')
        parts.append(f"<table>{''.join(rows)}</table>")
    return "".join(parts)


def card(title: str, value: str, note: str = "") -> str:
    """One summary card (the report's ``.card`` style); every section's cards are made here."""
    extra = f'<div class="n">{escape(note)}</div>' if note else ""
    return f'<div class="card"><div class="k">{escape(title)}</div><div class="v">{escape(value)}</div>{extra}</div>'


def _money(value: Any, currency: str) -> str:
    number = finite(value)
    return f"{number:,.2f} {currency}".strip() if number is not None else "–"


def _number(value: Any) -> str:
    number = finite(value)
    if number is None:
        return "–"
    return f"{int(number):,}" if number == int(number) and abs(number) >= 1 else f"{number:,.3f}"
