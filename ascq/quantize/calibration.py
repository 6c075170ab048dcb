"""Calibration token blocks from a dataset: a local text/json/jsonl/parquet file or folder, or a Hub dataset
id.

Loaded with the `datasets` library, tokenized, concatenated (eos between documents), packed into
`seq_len`-token blocks; the first `num_samples` blocks are used. Default: the fixture corpus's calibration
slice bundled with ascq.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from ascq.core.errors import AscqError
from ascq.paths import CALIB_TEXT, portable_name

log = logging.getLogger(__name__)
BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclasses.dataclass
class CalibrationSet:
    dataset: str
    input_ids: torch.Tensor  # [num_samples, seq_len] int64

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub ($HF_ENDPOINT) answers a TCP connect; False when HF_HUB_OFFLINE is set.

    Checked before any Hub download so an offline machine gets a clear error at once, not minutes of retries.
    """
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection(
            (url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=timeout
        ):
            return True
    except OSError:
        return False


def _local_files(path: Path) -> tuple[str, list[str]]:
    files = sorted(p for p in path.rglob("*") if p.suffix in BUILDERS) if path.is_dir() else [path]
    kinds = {BUILDERS.get(p.suffix) for p in files}
    if not files or None in kinds:
        raise AscqError(f"calibration data {path}: expected .txt, .json, .jsonl or .parquet files")
    if len(kinds) > 1:
        raise AscqError(f"calibration folder {path} mixes file types {sorted(kinds)}; use one type")
    return kinds.pop(), [str(p) for p in files]


def load_texts(source: str | Path | None) -> tuple[str, list[str]]:
    """(dataset label, documents) of a local file/folder or a Hub dataset id, without datasets' own progress
    bars (convert reports its steps itself)."""
    import datasets

    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return _load_texts(datasets, str(source or CALIB_TEXT))
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


def _load_texts(datasets: Any, source: str) -> tuple[str, list[str]]:
    path = Path(source)
    try:
        if path.exists():
            builder, files = _local_files(path)
            kwargs = {"sample_by": "document"} if builder == "text" else {}
            data = datasets.load_dataset(builder, data_files=files, split="train", **kwargs)
        elif path.suffix in BUILDERS or source.startswith((".", "/")):
            raise AscqError(f"calibration data {source} does not exist")
        elif not hub_reachable():
            raise AscqError(
                f"calibration dataset {source!r} is not a local path and the Hugging Face Hub is "
                f"unreachable (offline?)"
            )
        else:
            data = datasets.load_dataset(source, split="train")
    except AscqError:
        raise
    except Exception as exc:  # datasets raises many types (connection, format, missing file)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise AscqError(
            f"cannot load calibration dataset {source!r} (a local file/folder, or a Hub id when online): "
            f"{first}"
        ) from None
    column = (
        "text"
        if "text" in data.column_names
        else next((c for c, f in data.features.items() if getattr(f, "dtype", None) == "string"), None)
    )
    if column is None:
        raise AscqError(
            f"calibration dataset {source}: no text column (columns: {', '.join(data.column_names)})"
        )
    return portable_name(source), [t for t in data[column] if t]


def pack_tokens(
    token_lists: list[list[int]], eos_id: int | None, seq_len: int, num_samples: int
) -> torch.Tensor:
    """Concatenate documents (eos after each) and cut `num_samples` blocks of `seq_len` tokens."""
    stream: list[int] = []
    need = seq_len * num_samples
    for ids in token_lists:
        stream.extend(ids)
        if eos_id is not None:
            stream.append(eos_id)
        if len(stream) >= need:
            break
    num_blocks = min(num_samples, len(stream) // seq_len)
    if num_blocks == 0:
        raise AscqError(
            f"calibration data has {len(stream)} tokens, fewer than one block of --seq-len {seq_len}"
        )
    if num_blocks < num_samples:
        log.warning(
            "calibration data gives only %d blocks of %d tokens (asked for %d)",
            num_blocks,
            seq_len,
            num_samples,
        )
    return torch.tensor(stream[: num_blocks * seq_len], dtype=torch.long).view(num_blocks, seq_len)


def load_calibration(source: str | Path | None, tokenizer, num_samples: int, seq_len: int) -> CalibrationSet:
    if num_samples < 1 or seq_len < 2:
        raise AscqError("--num-samples must be >= 1 and --seq-len >= 2")
    label, texts = load_texts(source)
    token_lists = []
    total = 0
    for text in texts:  # tokenize lazily: stop once there are enough tokens
        # no "longer than" warning
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        token_lists.append(ids)
        total += len(ids) + 1
        if total >= num_samples * seq_len:
            break
    return CalibrationSet(label, pack_tokens(token_lists, tokenizer.eos_token_id, seq_len, num_samples))
