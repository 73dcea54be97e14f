"""A small safetensors writer over numpy, bfloat16 included (numpy has no bf16: we store its bits).

Used to write test checkpoints exactly as Hugging Face does (`{"format": "pt"}` metadata, 8-byte
aligned header, tensors in name order), single-file or sharded with `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

# numpy dtype name -> safetensors dtype tag; "bfloat16" arrays are uint16 bit patterns tagged as BF16
_DTYPE_TAGS = {
    "float32": "F32",
    "float16": "F16",
    "int32": "I32",
    "int64": "I64",
    "uint32": "U32",
    "uint8": "U8",
    "int8": "I8",
    "bool": "BOOL",
}


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to even) and return the 16-bit patterns."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + rounding) >> 16).astype(np.uint16)


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class BF16:
    """Marks a uint16 array as bfloat16 bit patterns for `write_safetensors`."""

    __slots__ = ("bits",)

    def __init__(self, bits: np.ndarray) -> None:
        self.bits = np.ascontiguousarray(bits, dtype=np.uint16)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)


Tensor = np.ndarray | BF16


def _tag_and_bytes(tensor: Tensor) -> tuple[str, bytes]:
    if isinstance(tensor, BF16):
        return "BF16", tensor.bits.tobytes()
    tag = _DTYPE_TAGS.get(tensor.dtype.name)
    if tag is None:
        raise ValueError(f"cannot store dtype {tensor.dtype} in safetensors")
    return tag, np.ascontiguousarray(tensor).tobytes()


def write_safetensors(
    path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        tag, blob = _tag_and_bytes(tensors[name])
        header[name] = {
            "dtype": tag,
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for blob in blobs:
            f.write(blob)


def write_sharded_safetensors(folder: Path, tensors: Mapping[str, Tensor], num_shards: int) -> list[Path]:
    """Write `model.safetensors` (one shard) or `model-0000i-of-0000n.safetensors` plus the index."""
    if num_shards <= 1:
        path = folder / "model.safetensors"
        write_safetensors(path, tensors)
        return [path]
    names = sorted(tensors)
    groups = [names[i::num_shards] for i in range(num_shards)]
    weight_map: dict[str, str] = {}
    paths = []
    for i, group in enumerate(groups, start=1):
        filename = f"model-{i:05d}-of-{num_shards:05d}.safetensors"
        write_safetensors(folder / filename, {n: tensors[n] for n in group})
        weight_map.update(dict.fromkeys(group, filename))
        paths.append(folder / filename)
    total_size = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return paths
