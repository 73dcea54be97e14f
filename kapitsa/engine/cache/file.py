"""One prefix checkpoint as a safetensors file whose arrays carry checksums.

The metadata holds a CRC-32 of every array (over its name, dtype, shape and bytes), so corrupt data
under an intact header, a cut-short file or an edited shape fails `read_prefix_file` instead of
reaching the model. Writes go through a 0600 temporary file that is fsynced and renamed, then the
folder is fsynced: a reader sees the whole file or none. Arrays are written from `PreparedArray`s
made on the engine thread, so the writer thread calls no MLX function.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path

import mlx.core as mx
import numpy as np

from kapitsa.private_files import open_private, sync_dir, sync_file

SUFFIX = ".safetensors"
TMP_PREFIX = "tmp-"
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_DTYPE_TAGS = {
    mx.bool_: "BOOL", mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64",
    mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64",
    mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32",
}  # fmt: skip
_TAG_SIZES = {tag: dtype.size for dtype, tag in _DTYPE_TAGS.items()}
# numpy has no bfloat16: its bits travel as uint16
_NUMPY_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64,
    "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
    "F16": np.float16, "BF16": np.uint16, "F32": np.float32,
}  # fmt: skip


class CorruptPrefixFile(ValueError):
    """The file's bytes are not what was written: delete it, never serve it."""


@dataclass(slots=True, frozen=True)
class PreparedArray:
    """An evaluated array ready for another thread to write: its bytes as a memoryview."""

    name: str
    tag: str
    shape: tuple[int, ...]
    data: memoryview

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def prepare_arrays(arrays: Mapping[str, mx.array]) -> list[PreparedArray]:
    """Evaluate `arrays` and take their buffers (call on the thread that made them)."""
    mx.eval(*arrays.values())
    return [
        PreparedArray(name, _DTYPE_TAGS[a.dtype], tuple(a.shape), memoryview(a))
        for name, a in sorted(arrays.items())
    ]


def _contiguous_bytes(view: memoryview) -> memoryview:
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


def _checksum(name: str, tag: str, shape: Sequence[int], data: memoryview) -> str:
    crc = zlib.crc32(f"{name}|{tag}|{list(shape)}".encode())
    return f"{zlib.crc32(data, crc):08x}"


def write_prefix_file(
    folder: Path, name: str, arrays: Sequence[PreparedArray], metadata: Mapping[str, str]
) -> Path:
    """Write `folder/name.safetensors` atomically and durably; returns its path.

    Args:
        folder: an existing folder.
        name: the file name without its suffix.
        arrays: from `prepare_arrays`.
        metadata: string metadata; "checksums" is added.
    """
    blobs = [_contiguous_bytes(a.data) for a in arrays]
    checksums = {a.name: _checksum(a.name, a.tag, a.shape, b) for a, b in zip(arrays, blobs, strict=True)}
    header: dict[str, object] = {"__metadata__": {**metadata, "checksums": json.dumps(checksums)}}
    offset = 0
    for a, blob in zip(arrays, blobs, strict=True):
        header[a.name] = {
            "dtype": a.tag,
            "shape": list(a.shape),
            "data_offsets": [offset, offset + blob.nbytes],
        }
        offset += blob.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    final = folder / f"{name}{SUFFIX}"
    tmp = folder / f"{TMP_PREFIX}{name}-{secrets.token_hex(4)}{SUFFIX}"
    fd = open_private(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(header_bytes)))
            f.write(header_bytes)
            for blob in blobs:
                f.write(blob)
            f.flush()
            sync_file(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_dir(folder)
    return final


def read_header(path: Path) -> dict[str, object]:
    """The JSON header of a safetensors file, checked against the file's size; raises CorruptPrefixFile."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CorruptPrefixFile("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > _MAX_HEADER_BYTES:
            raise CorruptPrefixFile("header too large")
        raw = f.read(size)
    try:
        header = json.loads(raw)
    except ValueError as err:
        raise CorruptPrefixFile(f"unreadable header: {err}") from err
    if not isinstance(header, dict):
        raise CorruptPrefixFile("the header is not a JSON object")
    _check_layout(header, path.stat().st_size - 8 - size)
    return header


def _check_layout(header: dict[str, object], data_bytes: int) -> None:
    """Every tensor's dtype is known and its offsets tile the data area exactly."""
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            tag, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]  # type: ignore[index]
            expected = prod(int(d) for d in shape) * _TAG_SIZES[tag]
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptPrefixFile(f"bad entry for {name}: {err}") from err
        if end - begin != expected:
            raise CorruptPrefixFile(f"{name}: {end - begin} bytes for shape {shape}")
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise CorruptPrefixFile("tensor data has gaps or overlaps")
        position = end
    if position != data_bytes:
        raise CorruptPrefixFile(f"{data_bytes} bytes of tensor data where the header says {position}")


def read_prefix_bytes(data: bytes | memoryview) -> tuple[list[PreparedArray], dict[str, str]]:
    """The arrays (as byte views, no MLX: any thread may call it) and metadata of a checkpoint
    file's bytes, each array checked against its checksum; raises CorruptPrefixFile."""
    view = memoryview(data)
    if len(view) < 8:
        raise CorruptPrefixFile("shorter than a safetensors header")
    (size,) = struct.unpack("<Q", view[:8])
    if size > min(_MAX_HEADER_BYTES, len(view) - 8):
        raise CorruptPrefixFile("header too large")
    try:
        header = json.loads(bytes(view[8 : 8 + size]))
        checksums = json.loads(header["__metadata__"]["checksums"])
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptPrefixFile(f"unreadable header: {err}") from err
    _check_layout(header, len(view) - 8 - size)
    arrays = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = (8 + size + o for o in info["data_offsets"])
        array = PreparedArray(name, info["dtype"], tuple(info["shape"]), view[begin:end])
        if _checksum(name, array.tag, array.shape, array.data) != checksums.get(name):
            raise CorruptPrefixFile(f"checksum mismatch in {name}")
        arrays.append(array)
    if {a.name for a in arrays} != set(checksums):
        raise CorruptPrefixFile("the arrays are not the checksummed ones")
    return arrays, header["__metadata__"]


def arrays_from_bytes(arrays: Sequence[PreparedArray]) -> dict[str, mx.array]:
    """MLX arrays of `read_prefix_bytes`'s views (copies; call on the thread that uses them)."""
    out = {}
    for a in arrays:
        dtype = _NUMPY_DTYPES[a.tag]
        host = np.frombuffer(a.data, dtype=dtype).reshape(a.shape)
        out[a.name] = mx.array(host).view(mx.bfloat16) if a.tag == "BF16" else mx.array(host)
    return out


def read_metadata(path: Path) -> dict[str, str]:
    """The `__metadata__` of a checkpoint file, from its header alone."""
    meta = read_header(path).get("__metadata__", {})
    if not isinstance(meta, dict):
        raise CorruptPrefixFile("metadata is not an object")
    return meta


def read_prefix_file(path: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Arrays and metadata of a checkpoint file whose every array matches its checksum.

    Raises:
        CorruptPrefixFile: the layout, a checksum or the set of arrays does not match.
        OSError: the file cannot be read (e.g. it was deleted meanwhile).
    """
    header = read_header(path)
    meta = header.get("__metadata__", {})
    try:
        checksums = json.loads(meta["checksums"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptPrefixFile("no checksums in the metadata") from err
    arrays = mx.load(str(path))
    mx.eval(*arrays.values())
    if set(arrays) != set(checksums):
        raise CorruptPrefixFile("the arrays are not the checksummed ones")
    for name, a in arrays.items():
        if (
            _checksum(name, _DTYPE_TAGS[a.dtype], a.shape, _contiguous_bytes(memoryview(a)))
            != checksums[name]
        ):
            raise CorruptPrefixFile(f"checksum mismatch in {name}")
    return arrays, meta  # type: ignore[return-value]
