"""A GGUF file's header checked against the file's size before any reader allocates for it.

gguf's `GGUFReader` (and transformers' GGUF loader, which uses it) trusts the counts a header declares: an
array whose count field says 2^62 makes it allocate for 2^62 items. `check_gguf_header` walks the header as
the format defines it (magic, version 2 or 3, tensor and key/value counts, typed values, nested arrays, tensor
infos, alignment, tensor data), reading only the bytes it skips over and checking every declared count times
its items' smallest size against the bytes left in the file first, so a hostile file costs at most its own
size in time and a constant in memory, and is refused in one line.
"""

from __future__ import annotations

import math
import mmap
import struct
from contextlib import nullcontext
from pathlib import Path

from ascq.core.errors import AscqError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # those gguf's reader supports (version 1 used 32-bit counts)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8  # arrays of arrays: llama.cpp writes at most two levels
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
STRING, ARRAY, UINT32 = 8, 9, 4
# fixed-size value types of the format: type id -> (struct code, bytes)
SCALARS = {
    0: ("B", 1),
    1: ("b", 1),
    2: ("H", 2),
    3: ("h", 2),
    4: ("I", 4),
    5: ("i", 4),
    6: ("f", 4),
    7: ("?", 1),
    10: ("Q", 8),
    11: ("q", 8),
    12: ("d", 8),
}
STRING_LENGTH_BYTES = 8
TENSOR_INFO_MIN_BYTES = STRING_LENGTH_BYTES + 4 + 4 + 8  # name length, n_dims, type, offset


class _Header:
    """A bounded cursor over the file's bytes (memory-mapped: only the pages read become resident): every read
    is checked against the bytes left."""

    def __init__(self, data: mmap.mmap | bytes, name: str) -> None:
        self.data, self.size, self.name, self.order, self.pos = data, len(data), name, "<", 0

    def left(self) -> int:
        return self.size - self.pos

    def fail(self, why: str) -> AscqError:
        return AscqError(f"{self.name} is not a readable GGUF file: {why} (at byte {self.pos})")

    def need(self, num_bytes: int, what: str) -> None:
        if num_bytes > self.left():
            raise self.fail(f"{what} needs {num_bytes:,d} bytes, the file has {self.left():,d} left")

    def read(self, num_bytes: int, what: str) -> bytes:
        self.need(num_bytes, what)
        self.pos += num_bytes
        return self.data[self.pos - num_bytes : self.pos]

    def skip(self, num_bytes: int, what: str) -> None:
        self.need(num_bytes, what)
        self.pos += num_bytes

    def scalar(self, code: str, num_bytes: int, what: str) -> int | float | bool:
        self.need(num_bytes, what)
        self.pos += num_bytes
        return struct.unpack_from(self.order + code, self.data, self.pos - num_bytes)[0]

    def count(self, item_bytes: int, what: str) -> int:
        """A declared item count, refused unless that many items of at least `item_bytes` fit the file."""
        count = int(self.scalar("Q", 8, f"{what} count"))
        self.need(count * item_bytes, f"{what} ({count:,d} declared)")
        return count

    def string(self, what: str) -> bytes:
        return self.read(self.count(1, what), what)

    def skip_strings(self, count: int, what: str) -> None:
        """Skip `count` length-prefixed strings (a vocabulary: the one loop that must be fast)."""
        length_of, data, pos, size = (
            struct.Struct(self.order + "Q").unpack_from,
            self.data,
            self.pos,
            self.size,
        )
        for _ in range(count):
            if pos + STRING_LENGTH_BYTES > size:
                break
            pos += STRING_LENGTH_BYTES + length_of(data, pos)[0]
            if pos > size:
                break
        else:
            self.pos = pos
            return
        self.pos = min(pos, size)
        raise self.fail(f"an item of {what} runs past the end of the file")

    def skip_value(self, value_type: int, what: str, depth: int = 0) -> None:
        if value_type in SCALARS:
            self.skip(SCALARS[value_type][1], what)
        elif value_type == STRING:
            self.skip(self.count(1, what), what)
        elif value_type == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
            item_type = int(self.scalar("I", 4, f"{what} item type"))
            if item_type in SCALARS:
                self.skip(self.count(SCALARS[item_type][1], what) * SCALARS[item_type][1], what)
            elif item_type == STRING:
                self.skip_strings(self.count(STRING_LENGTH_BYTES, what), what)
            elif item_type == ARRAY:
                for _ in range(self.count(4 + 8, what)):  # each: item type and count
                    self.skip_value(ARRAY, what, depth + 1)
            else:
                raise self.fail(f"{what} has unknown item type {item_type}")
        else:
            raise self.fail(f"{what} has unknown value type {value_type}")


def check_gguf_header(path: Path) -> None:
    """Raise a one-line AscqError unless every count, string, array, tensor shape and tensor data range the
    header of GGUF file `path` declares fits inside the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    size = path.stat().st_size
    with (
        open(path, "rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else nullcontext(b"") as data,
    ):
        header = _Header(data, path.name)
        if header.read(4, "the magic") != MAGIC:
            raise header.fail("it does not start with GGUF")
        version = int(header.scalar("I", 4, "the version"))
        if version & 0xFFFF == 0:  # written on a big-endian machine
            header.order = ">"
            version = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in VERSIONS:
            raise header.fail(f"version {version} (supported: {', '.join(map(str, VERSIONS))})")
        num_tensors = header.count(TENSOR_INFO_MIN_BYTES, "the tensor")
        num_values = header.count(STRING_LENGTH_BYTES + 4, "the key/value")
        alignment = DEFAULT_ALIGNMENT
        for _ in range(num_values):
            key = header.string("a key").decode("utf-8", "replace")
            value_type = int(header.scalar("I", 4, f"the type of {key}"))
            if key == ALIGNMENT_KEY and value_type == UINT32:
                alignment = int(header.scalar("I", 4, key))
                if alignment == 0 or alignment & (alignment - 1):
                    raise header.fail(f"{ALIGNMENT_KEY} {alignment} is not a power of two")
            else:
                header.skip_value(value_type, key)
        extents = []
        for _ in range(num_tensors):
            name = header.string("a tensor name").decode("utf-8", "replace")
            num_dims = int(header.scalar("I", 4, f"the dimensions of {name}"))
            if num_dims > MAX_DIMS:
                raise header.fail(f"tensor {name} has {num_dims} dimensions (at most {MAX_DIMS})")
            header.need(num_dims * 8, f"the shape of {name}")
            shape = [int(header.scalar("Q", 8, f"the shape of {name}")) for _ in range(num_dims)]
            type_id = int(header.scalar("I", 4, f"the type of {name}"))
            offset = int(header.scalar("Q", 8, f"the offset of {name}"))
            try:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
            except (ValueError, KeyError):
                raise header.fail(f"tensor {name} has unknown type {type_id}") from None
            num_elements = math.prod(shape)
            if shape and shape[0] % block:
                raise header.fail(f"tensor {name}'s rows ({shape[0]}) are not whole blocks of {block}")
            extents.append((name, offset, num_elements // block * block_bytes))
        data_start = -(-header.pos // alignment) * alignment
    for name, offset, num_bytes in extents:
        if offset % alignment or data_start + offset + num_bytes > size:
            raise AscqError(
                f"{path.name} is not a readable GGUF file: tensor {name}'s data ({num_bytes:,d} bytes at "
                f"offset {offset:,d}) lies outside the file ({size:,d} bytes) or is not aligned"
            )
