"""What ``trainforge ckpt list`` and ``inspect`` print (rich), from what ``checkpoint/inspect.py`` found."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Group, RenderableType
from rich.table import Table

from trainforge.checkpoint.hashing import LABELS as HASH_LABELS

if TYPE_CHECKING:
    from trainforge.checkpoint.inspect import Listed

LISTED_METRICS = ("val/loss", "val/accuracy", "train/loss")


def human_bytes(size: float | None) -> str:
    if size is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(size) < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def human_time(stamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) if stamp is not None else "-"


def list_table(location: str, rows: Sequence[Listed]) -> Table:
    """The table ``ckpt list`` prints: one row per directory, ``valid`` or why not."""
    shown_metrics = [m for m in LISTED_METRICS if any(m in r.metrics for r in rows)]
    valid = sum(r.valid for r in rows)
    table = Table(title=f"{location}: {valid} valid of {sum(r.kind == 'checkpoint' for r in rows)} checkpoint(s)")
    table.add_column("name", no_wrap=True)
    table.add_column("step", justify="right")
    table.add_column("epoch", justify="right")
    for metric in shown_metrics:
        table.add_column(metric, justify="right")
    table.add_column("size", justify="right")
    table.add_column("created")
    table.add_column("status")
    for row in rows:
        status = f"[green]{row.status}[/]" if row.valid else f"[red]{row.status}[/]"
        table.add_row(
            row.name,
            _or_dash(row.step),
            _or_dash(row.epoch),
            *(f"{row.metrics[m]:.4f}" if m in row.metrics else "-" for m in shown_metrics),
            human_bytes(row.size_bytes),
            human_time(row.created_at),
            status,
        )
    return table


def inspection_view(report: dict[str, Any]) -> RenderableType:
    """What ``ckpt inspect`` prints without ``--json``."""
    parts: list[RenderableType] = [f"[bold]{report['path']}[/]"]
    manifest = report["manifest"]
    if manifest is not None:
        integrity = "sizes match" if report["sizes_match_manifest"] else "[red]sizes do not match[/]"
        parts.append(
            f"manifest: format {manifest['format_version']}, {len(manifest['files'])} files, "
            f"written {human_time(manifest.get('created_at'))}; {integrity} "
            f"(run `trainforge ckpt verify` for the {HASH_LABELS.get(manifest.get('hash', 'sha256'), '')} check)"
        )
    sharding = report.get("sharding") or {}
    if sharding.get("layout") == "sharded":
        ranks = "; ".join(
            f"rank {rank}: {v['files']} file(s), {human_bytes(v['bytes'])}" for rank, v in sharding["ranks"].items()
        )
        parts.append(f"sharding: sharded over {sharding['world_size']} rank(s) (torch.distributed.checkpoint); {ranks}")
    writers = {"step": report["step"], "epoch": report["epoch"], "world_size": report["world_size"]}
    parts.append(_pairs("written at", {**writers, "plan": report["plan"]}))
    parts.append(_pairs("versions", report["versions"]))
    shown = {k: _short(v) for k, v in sorted(report["metrics"].items()) if k.startswith(("train/", "val/"))}
    parts.append(_pairs("metrics", shown) + f" ({len(report['metrics']) - len(shown)} more with --json)")
    components = Table(title="components", show_header=True)
    for column in ("component", "state", "files"):
        components.add_column(column)
    for name, component in report["components"].items():
        values = ", ".join(f"{k}={_short(v)}" for k, v in component["values"].items())
        components.add_row(name, values or "-", _files(component))
    parts.append(components)
    config = Table(title="config", show_header=False)
    config.add_column("section", style="bold")
    config.add_column("values")
    for section, values in report["config"].items():
        if isinstance(values, dict):
            text = ", ".join(f"{k}={v}" for k, v in values.items() if v is not None and v != {})
        else:
            text = str(values)
        config.add_row(section, text)
    parts.append(config)
    for problem in report["problems"]:
        parts.append(f"[red]problem:[/] {problem}")
    return Group(*parts)


def _pairs(title: str, values: dict[str, Any]) -> str:
    body = ", ".join(f"{k} {v}" for k, v in values.items()) if values else "-"
    return f"{title}: {body}"


def _files(component: dict[str, Any]) -> str:
    """Where a component's state is kept beside its values, and what its weights hold."""
    kept = []
    if component.get("tensors") == "sharded":
        kept.append("DCP shards")
    elif component.get("tensors"):
        kept.append(f"{component['tensors']} {human_bytes(component.get('size_bytes'))}")
    if component.get("export"):
        kept.append(f"{component['export']['file']} {human_bytes(component['export']['size_bytes'])}")
    weights = component.get("weights")
    if weights:
        dtypes = ", ".join(f"{dtype} {v['tensors']}" for dtype, v in weights["dtypes"].items())
        kept.append(f"{weights['tensors']} tensors, {weights['parameters']:,} parameters ({dtypes})")
    if component.get("rank_values"):
        kept.append(f"own values on {component['rank_values']} rank(s)")
    if component.get("rank_tensors"):
        kept.append("own tensors per rank")
    return "; ".join(kept) or "-"


def _short(value: Any) -> Any:
    return f"{value:.6g}" if isinstance(value, float) else value


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)
