"""Read a Hugging Face safetensors checkpoint tensor by tensor, without loading the whole model.

Every shard's header is checked against its file size up front, so a truncated or corrupted shard is an
`AscqError` before any work starts (reading past the end of a memory-mapped file would crash the process).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from ascq.errors import AscqError

INDEX_NAME = "model.safetensors.index.json"


def _check_shard(path: Path) -> list[str]:
    """Tensor names of a shard whose header is valid and whose data fits the file."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(header_len))
        data_end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise AscqError(f"{path.name} is not a valid safetensors file ({exc}); the checkpoint is corrupted") from None
    if 8 + header_len + data_end != size:
        raise AscqError(
            f"{path.name} is truncated or corrupted: its header describes {8 + header_len + data_end} bytes, "
            f"the file has {size}"
        )
    return [k for k in header if k != "__metadata__"]


class CheckpointReader:
    """Tensor name -> shard map of a checkpoint folder; `get` reads one tensor."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / INDEX_NAME
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as exc:
                raise AscqError(f"{index} is not a valid safetensors index: {exc}") from None
        elif (self.model_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise AscqError(f"{self.model_dir}: no model.safetensors or {INDEX_NAME} (only safetensors checkpoints are read)")
        self.file_of: dict[str, str] = {}
        for name in files:
            path = self.model_dir / name
            if not path.is_file():
                raise AscqError(f"{self.model_dir}: checkpoint file {name} is missing")
            self.file_of.update(dict.fromkeys(_check_shard(path), name))
        self.num_bytes = sum((self.model_dir / f).stat().st_size for f in files)

    def names(self) -> list[str]:
        return list(self.file_of)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise AscqError(f"{self.model_dir}: tensor {name} is missing from the checkpoint")
        with safe_open(self.model_dir / self.file_of[name], framework="pt") as f:
            return f.get_tensor(name)

    def get_prefix(self, prefix: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """All tensors whose name starts with `prefix`, prefix stripped (one layer's weights).

        Each tensor is read through its own short-lived mapping, so at most one source tensor's pages are resident
        next to the converted copies (a whole mapped layer would add its size to the peak RSS).
        """
        state = {}
        for name in self.file_of:
            if name.startswith(prefix) and not name.endswith("rotary_emb.inv_freq"):
                tensor = self.get(name)
                state[name[len(prefix):]] = tensor.to(dtype) if dtype is not None else tensor
        return state

    def dtype(self) -> torch.dtype:
        """The dtype of the checkpoint's floating-point weights (that of the first layer's tensors)."""
        name = next((n for n in self.file_of if n.startswith("model.layers.")), next(iter(self.file_of)))
        return self.get(name).dtype
