"""`ascq zoo list`: one row per entry of the zoo folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ascq.formats.manifest import MANIFEST_NAME, read_manifest
from ascq.paths import zoo_root

COLUMNS = ("name", "base model", "recipe", "format", "size", "ppl", "quality delta")


def list_entries(zoo: Path | None = None) -> list[dict[str, Any]]:
    zoo = Path(zoo) if zoo else zoo_root()
    if not zoo.is_dir():
        return []
    return [read_manifest(d) for d in sorted(zoo.iterdir()) if (d / MANIFEST_NAME).is_file()]


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
    )


def format_table(manifests: list[dict[str, Any]]) -> str:
    rows = [COLUMNS] + [_row(m) for m in manifests]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if not manifests:
        lines.append("(no entries)")
    return "\n".join(lines)
