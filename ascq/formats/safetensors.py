"""The one safetensors checkpoint reader of ascq.

A checkpoint folder is read through its shard index (`*.safetensors.index.json`) when it has one, else
`model.safetensors`, else every `*.safetensors` file. Every shard's header is checked against its file size up
front, so a truncated or corrupted shard is an `AscqError` before any work starts (reading past the end of a
memory-mapped file would crash the process); a tensor stored twice, or an index that disagrees with the
shards, is named too.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from ascq.core.errors import AscqError

INDEX_NAME = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"


# safetensors' own limit on the header (the library refuses a longer one)
MAX_HEADER_BYTES = 100_000_000
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def _read_header(path: Path) -> dict[str, dict]:
    """Tensor name -> header entry (dtype, shape, data_offsets) of a shard whose header fits the file and
    whose tensors exactly tile its data (as the safetensors library requires), checked before anything is
    allocated for what the header declares; anything else is one line."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(size - 8, MAX_HEADER_BYTES):
                raise ValueError(f"its header length {header_len:,d} exceeds the file or the format's limit")
            header = json.loads(f.read(header_len))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        header.pop("__metadata__", None)
        data_end = _check_tensors(header)
    except RecursionError:
        raise AscqError(
            f"{path.name} is not a valid safetensors file (its header is nested too deeply)"
        ) from None
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise AscqError(
            f"{path.name} is not a valid safetensors file ({' '.join(str(exc).split())[:300]}); the "
            "checkpoint is corrupted"
        ) from None
    if 8 + header_len + data_end != size:
        raise AscqError(
            f"{path.name} is truncated or corrupted: its header describes {8 + header_len + data_end} bytes, "
            f"the file has {size}"
        )
    return header


def _check_tensors(header: dict) -> int:
    """The end of the data the header's tensors describe (the caller compares it with the file); ValueError
    unless each has a known dtype, a shape of non-negative integers and offsets whose span is its size, the
    tensors back to back."""
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or info.get("dtype") not in DTYPE_BYTES:
            raise ValueError(f"tensor {name!r} has no known dtype")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"tensor {name!r} has an invalid shape")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ValueError(f"tensor {name!r} has invalid data offsets")
        if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[info["dtype"]]:
            raise ValueError(f"tensor {name!r}: its data offsets do not span its shape and dtype")
        spans.append((offsets[0], offsets[1]))
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise ValueError("the tensors' data overlap or leave gaps")
        end = stop
    return end


def _index_path(model_dir: Path) -> Path | None:
    indexes = sorted(model_dir.glob(f"*{INDEX_SUFFIX}"))
    if len(indexes) > 1:
        raise AscqError(f"{model_dir}: more than one shard index ({', '.join(p.name for p in indexes)})")
    return indexes[0] if indexes else None


class CheckpointReader:
    """Tensor name -> shard map of a safetensors checkpoint folder; `get` reads one tensor.

    Outside `opened()` each tensor is read through its own short-lived mapping, so at most one source tensor's
    pages are resident next to the converted copies; inside it every shard stays open (a linear's tensors may
    sit in different shards).
    """

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.index_path = _index_path(self.model_dir)
        weight_map = self._weight_map() if self.index_path else None
        if weight_map is not None:
            files = sorted(set(weight_map.values()))
        elif (self.model_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
        if not files:
            raise AscqError(
                f"{self.model_dir}: model.safetensors is missing (no *.safetensors files nor a shard index; "
                "only safetensors checkpoints are read)"
            )
        self.file_of: dict[str, str] = {}
        self.headers: dict[str, dict] = {}
        for name in files:
            path = self.model_dir / name
            if not path.is_file():
                raise AscqError(f"{self.model_dir}: checkpoint file {name} is missing")
            header = _read_header(path)
            for tensor, info in header.items():
                if tensor in self.file_of:
                    raise AscqError(
                        f"{self.model_dir.name}: tensor {tensor} is in both {self.file_of[tensor]} and {name}"
                    )
                self.file_of[tensor] = name
                self.headers[tensor] = info
        if weight_map is not None:
            self._check_index(weight_map)
        self.num_bytes = sum((self.model_dir / f).stat().st_size for f in files)
        self._handles: dict[str, object] | None = None

    def _weight_map(self) -> dict[str, str]:
        try:
            weight_map = json.loads(self.index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not a mapping")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise AscqError(f"{self.index_path} is not a valid safetensors index: {exc}") from None
        return weight_map

    def _check_index(self, weight_map: dict[str, str]) -> None:
        for name in sorted(set(weight_map) | set(self.file_of)):
            if weight_map.get(name) != self.file_of.get(name):
                raise AscqError(
                    f"{self.model_dir.name}: {self.index_path.name} maps {name} to {weight_map.get(name)}, "
                    f"but it is in {self.file_of.get(name)}"
                )

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)

    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype, shape) of a tensor, from the header."""
        info = self.headers[name]
        return info["dtype"], tuple(info["shape"])

    @contextlib.contextmanager
    def opened(self, files: Iterable[str] | None = None) -> Iterator[CheckpointReader]:
        """Keep every shard (or those of `files`) open (memory-mapped) while the block runs; `get` of a tensor
        in another shard opens it for that call."""
        with contextlib.ExitStack() as stack:
            self._handles = {
                f: stack.enter_context(safe_open(self.model_dir / f, framework="pt", device="cpu"))
                for f in sorted(set(self.file_of.values()) if files is None else set(files))
            }
            try:
                yield self
            finally:
                self._handles = None

    def get(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise AscqError(f"{self.model_dir}: tensor {name} is missing from the checkpoint")
        if self._handles is not None and self.file_of[name] in self._handles:
            return self._handles[self.file_of[name]].get_tensor(name)
        with safe_open(self.model_dir / self.file_of[name], framework="pt") as f:
            return f.get_tensor(name)

    def get_prefix(self, prefix: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """All tensors whose name starts with `prefix`, prefix stripped (one layer's weights)."""
        state = {}
        for name in self.file_of:
            if name.startswith(prefix) and not name.endswith("rotary_emb.inv_freq"):
                tensor = self.get(name)
                state[name[len(prefix) :]] = tensor.to(dtype) if dtype is not None else tensor
        return state

    def dtype(self) -> torch.dtype:
        """The dtype of the checkpoint's floating-point weights (that of the first layer's tensors)."""
        name = next((n for n in self.file_of if n.startswith("model.layers.")), next(iter(self.file_of)))
        return self.get(name).dtype
