"""`ascq zoo list`: one row per entry of the zoo folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ascq.core.errors import AscqError
from ascq.formats.manifest import MANIFEST_NAME, read_manifest
from ascq.paths import zoo_root

COLUMNS = ("name", "base model", "recipe", "format", "size", "ppl", "quality delta", "ppl measured on")


def list_entries(zoo: Path | None = None) -> list[dict[str, Any]]:
    """Every entry's manifest; one that does not read (`read_manifest`'s one-line error) is listed as
    invalid rather than hiding the others."""
    zoo = Path(zoo) if zoo else zoo_root()
    if not zoo.is_dir():
        return []
    return [_read(d) for d in sorted(zoo.iterdir()) if (d / MANIFEST_NAME).is_file()]


def _read(entry_dir: Path) -> dict[str, Any]:
    try:
        return read_manifest(entry_dir)
    except AscqError:
        return {"name": entry_dir.name, "format": "invalid ascq.json (zoo verify says why)"}


def eval_label(metrics: dict[str, Any]) -> str:
    """What an entry's perplexity was measured on (tokens and text): only rows with the same label compare."""
    if not metrics.get("perplexity"):
        return "-"
    tokens = metrics.get("num_eval_tokens")
    return f"{tokens:,d} tokens of {metrics.get('eval_text') or '?'}" if tokens else "?"


def _human_size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def _row(manifest: dict[str, Any]) -> tuple[str, ...]:
    metrics = manifest.get("metrics") or {}
    ppl, base = metrics.get("perplexity"), metrics.get("perplexity_base")
    delta = f"{100 * (ppl / base - 1):+.2f}%" if ppl and base else "-"
    recipe = manifest.get("recipe") or {}
    size = sum(f["size"] for f in (manifest.get("files") or {}).values())
    planned = manifest.get("planned") is not None  # config and sizes only: `zoo show` names the command
    return (
        manifest.get("name", "?"),
        manifest.get("base_model") or "-",
        "+".join(recipe.get("names", [])) or "-",
        "plan (no weights)" if planned else manifest.get("format", "?"),
        "-" if planned else (_human_size(size) if size else "-"),
        f"{ppl:.3f}" if ppl else "-",
        delta,
        eval_label(metrics),
    )


def format_table(manifests: list[dict[str, Any]]) -> str:
    rows = [COLUMNS] + [_row(m) for m in manifests]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if not manifests:
        lines.append("(no entries)")
    if len({row[-1] for row in rows[1:]} - {"-"}) > 1:
        lines.append("perplexities compare only between rows measured on the same tokens (last column)")
    return "\n".join(lines)
