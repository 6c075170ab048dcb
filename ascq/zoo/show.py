"""`ascq zoo show`: one entry's manifest in readable form (provenance, recipe, metrics, plan, files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ascq.formats.manifest import read_manifest
from ascq.zoo.listing import _human_size


def format_entry(entry_dir: Path) -> str:
    manifest = read_manifest(entry_dir)
    source = manifest.get("source") or {}
    recipe = manifest.get("recipe") or {}
    calibration = manifest.get("calibration") or {}
    conversion = manifest.get("conversion") or {}
    lines = [
        f"name         {manifest.get('name')}",
        f"path         {Path(entry_dir).resolve()}",
        f"source       {source.get('model', '-')}"
        + (f" @ {source['revision']}" if source.get("revision") else ""),
        f"base model   {manifest.get('base_model') or '-'}",
        f"license      {manifest.get('license') or '-'}",
        f"format       {manifest.get('format')}   scheme {manifest.get('scheme') or '-'}",
        f"recipe       {'+'.join(recipe.get('names', [])) or '-'}",
        "calibration  " + (", ".join(f"{k} {v}" for k, v in calibration.items()) if calibration else "-"),
        "conversion   " + (", ".join(f"{k} {v}" for k, v in conversion.items()) if conversion else "-"),
        "metrics      " + (", ".join(f"{k} {v}" for k, v in (manifest.get("metrics") or {}).items()) or "-"),
    ]
    lines += _plan_lines(manifest.get("planned"))
    files = manifest.get("files") or {}
    lines.append(f"files        {len(files)}, {_human_size(sum(f['size'] for f in files.values()))}")
    lines += [f"  {_human_size(f['size']):>10}  {f['sha256'][:16]}  {rel}" for rel, f in files.items()]
    return "\n".join(lines)


def _plan_lines(planned: dict[str, Any] | None) -> list[str]:
    if not planned:
        return []
    lines = [
        f"weights      none yet; produce them with: {planned['commands']['convert']}",
        f"serve with   {planned['commands']['serve']}",
        f"parameters   {planned['num_parameters'] / 1e9:.2f} B; KV cache "
        f"{planned['kv_cache_bytes_per_token']:,d} bytes/token",
        "plan         recipe        scheme         checkpoint   serve memory (weights + bf16 KV cache)",
    ]
    for recipe, row in planned["recipes"].items():
        memory = ", ".join(f"{k}: {_human_size(v['total_bytes'])}" for k, v in row["serve_memory"].items())
        lines.append(
            f"             {recipe:<13} {row['scheme']:<14} {_human_size(row['checkpoint_bytes']):>10}   "
            f"{memory}"
        )
    return lines
