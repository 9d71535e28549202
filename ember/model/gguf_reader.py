"""The GGUF container: header, metadata and tensor table, parsed fast.

gguf.GGUFReader slices a numpy memmap once per metadata element, which costs seconds on a
49k-token vocabulary at every start-up; this reader walks the same layout with struct over one
memoryview and hands tensors out as views of one memory map.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, overload

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType

_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, key/value count
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
# Linux 5.14+: map a range's pages in with one call (Python 3.11's mmap module lacks the name).
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_ALIGNMENT_KEY = "general.alignment"
_DEFAULT_ALIGNMENT = 32
_SCALARS: dict[int, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: _U32,
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: _U64,
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
# Arrays of scalars are read whole by numpy, which spells these types as struct does.
_ARRAY_DTYPES: dict[int, np.dtype] = {vtype: np.dtype(fmt.format) for vtype, fmt in _SCALARS.items()}


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF file; load_gguf reports it as ModelLoadError."""


class GGUFTensor(NamedTuple):
    """One tensor's description and its bytes, still in the file."""

    name: str
    tensor_type: QType
    shape: tuple[int, ...]  # GGML order: innermost dimension first
    data: np.ndarray  # uint8 view of the memory-mapped file: no copy, nothing read yet
    offset: int  # where `data` starts in the file


class _Cursor:
    """Bounds-checked little-endian reads moving forward through a buffer, so a truncated file
    fails with GGUFFormatError instead of yielding short values."""

    def __init__(self, buf: memoryview, lazy_strings: bool = False) -> None:
        self.buf = buf
        self.pos = 0
        self.lazy_strings = lazy_strings  # arrays of strings as StringArray, decoded when first read

    def skip(self, size: int) -> int:
        """Claim the next `size` bytes; return where they start."""
        start, end = self.pos, self.pos + size
        if end > len(self.buf):
            raise _truncated(start, end, len(self.buf))
        self.pos = end
        return start

    def scalar(self, fmt: struct.Struct) -> Any:
        return fmt.unpack_from(self.buf, self.skip(fmt.size))[0]

    def string(self) -> str:
        size = self.scalar(_U64)
        start = self.skip(size)
        return str(self.buf[start : self.pos], "utf-8")

    def value(self, vtype: int) -> Any:
        """A metadata value: a Python scalar, str, or a list of them (lists of lists when nested)."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        raise GGUFFormatError(f"unknown metadata value type {vtype}")

    def array(self) -> Sequence:
        item_type, count = self.scalar(_U32), self.scalar(_U64)
        if item_type in _ARRAY_DTYPES:
            dtype = _ARRAY_DTYPES[item_type]
            start = self.skip(dtype.itemsize * count)
            return np.frombuffer(self.buf, dtype, count, start).tolist()
        if item_type == GGUFValueType.STRING:
            return self.skip_strings(count) if self.lazy_strings else self.strings(count)
        return [self.value(item_type) for _ in range(count)]

    def skip_strings(self, count: int) -> StringArray:
        """`count` consecutive strings, walked over but not decoded: their bytes, copied (the file's map
        may close long before they are read)."""
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        start = pos
        for _ in range(count):
            if pos + 8 > end:
                raise _truncated(pos, pos + 8, end)
            pos += 8 + unpack(buf, pos)[0]
        if pos > end:
            raise _truncated(start, pos, end)
        self.pos = pos
        return StringArray(bytes(buf[start:pos]), count)

    def strings(self, count: int) -> list[str]:
        """`count` consecutive strings: string() inlined into one loop, as vocabularies and merge
        lists hold ~50k strings each and the per-call overhead would double the parse time."""
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out: list[str] = []
        for _ in range(count):
            if pos + 8 > end:
                raise _truncated(pos, pos + 8, end)
            (size,) = unpack(buf, pos)
            start, pos = pos + 8, pos + 8 + size
            if pos > end:  # checked before decoding, which would fail on a cut-off character
                raise _truncated(start, pos, end)
            out.append(str(buf[start:pos], "utf-8"))
        self.pos = pos
        return out


class StringArray(Sequence[str]):
    """A metadata array of strings kept as the file's bytes and decoded on first read (then kept as
    strings). The engine core parses a GGUF file for its weights, and needs the vocabulary's strings
    only for a structured-output request, if ever: for the default model's 49k tokens and 49k merges,
    opening the file took 0.014 s of CPU instead of 0.043 s, and the core keeps 1.5 MiB of bytes instead
    of 8.5 MiB of strings (tracemalloc; 2-core EPYC, 2026-12-05). A string that is not valid UTF-8 shows
    only when read, as GGUFFormatError."""

    def __init__(self, raw: bytes, count: int) -> None:
        self._raw: bytes | None = raw
        self._count = count
        self._strings: list[str] | None = None

    def _decoded(self) -> list[str]:
        if self._strings is None:
            assert self._raw is not None  # dropped only once decoded
            try:
                self._strings = _Cursor(memoryview(self._raw)).strings(self._count)
            except UnicodeDecodeError as exc:
                raise GGUFFormatError(f"a string is not valid UTF-8 ({exc})") from None
            self._raw = None
        return self._strings

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self._decoded()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())


def _truncated(start: int, end: int, size: int) -> GGUFFormatError:
    return GGUFFormatError(f"file ends at byte {size}, inside a field spanning bytes {start}-{end}")


class GGUFFile:
    """A parsed GGUF file: metadata as plain Python values, tensors as views of the mapped file.

    Only little-endian files of versions 2 and 3 are read, as llama.cpp writes them everywhere.
    """

    def __init__(self, path: str, lazy_strings: bool = False) -> None:
        """`lazy_strings`: arrays of strings come as StringArray, decoded when first read."""
        size = os.path.getsize(path)
        if size < _HEADER.size:
            raise GGUFFormatError(f"{size} bytes is too short for a GGUF header")
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = np.frombuffer(self._map, dtype=np.uint8)
        cursor = _Cursor(memoryview(self._data), lazy_strings)  # type: ignore[arg-type]  # numpy stubs: ndarray lacks __buffer__
        try:
            self.version, tensor_count, kv_count = self._read_header(cursor)
            self.fields = self._read_fields(cursor, kv_count)
            infos = [self._read_tensor_info(cursor) for _ in range(tensor_count)]
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"a string is not valid UTF-8 ({exc})") from None
        self.alignment = self._alignment()
        self.data_offset = (cursor.pos + self.alignment - 1) // self.alignment * self.alignment
        self.tensors = [self._tensor(*info) for info in infos]
        self._check_unique_names()

    @staticmethod
    def _read_header(cursor: _Cursor) -> tuple[int, int, int]:
        """(version, tensor count, key/value count), once the magic and version check out."""
        magic, version, tensor_count, kv_count = _HEADER.unpack_from(cursor.buf, cursor.skip(_HEADER.size))
        if magic != _GGUF_MAGIC:
            raise GGUFFormatError(f"bad magic {magic!r} (expected {_GGUF_MAGIC!r})")
        if version not in _GGUF_VERSIONS:
            # A byte-swapped small version number reads as a multiple of 65536.
            endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise GGUFFormatError(f"unsupported GGUF version {version}{endian}")
        return version, tensor_count, kv_count

    def _read_fields(self, cursor: _Cursor, count: int) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for _ in range(count):
            key, vtype = cursor.string(), cursor.scalar(_U32)
            if key in fields:
                raise GGUFFormatError(f"duplicate metadata key {key!r}")
            if key == _ALIGNMENT_KEY and vtype != GGUFValueType.UINT32:
                raise GGUFFormatError(f"{key} must be a UINT32, not value type {vtype}")
            fields[key] = cursor.value(vtype)
        return fields

    @staticmethod
    def _read_tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        """(name, GGML shape, raw type, offset within the data section) of the next tensor."""
        name, n_dims = cursor.string(), cursor.scalar(_U32)
        shape = struct.unpack_from(f"<{n_dims}Q", cursor.buf, cursor.skip(8 * n_dims))
        return name, shape, cursor.scalar(_U32), cursor.scalar(_U64)

    def _alignment(self) -> int:
        alignment = self.fields.get(_ALIGNMENT_KEY, _DEFAULT_ALIGNMENT)
        if alignment == 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"alignment {alignment} is not a power of two")
        return alignment

    def _check_unique_names(self) -> None:
        seen: set[str] = set()
        for tensor in self.tensors:
            if tensor.name in seen:
                raise GGUFFormatError(f"duplicate tensor {tensor.name!r}")
            seen.add(tensor.name)

    def _tensor(self, name: str, shape: tuple[int, ...], raw_type: int, offset: int) -> GGUFTensor:
        try:
            qtype = QType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown type {raw_type}") from None
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        if shape and shape[0] % block_size:
            raise GGUFFormatError(
                f"tensor {name!r} of type {qtype.name} has a row of {shape[0]} elements, "
                f"not a multiple of its {block_size}-element blocks"
            )
        start = self.data_offset + offset
        end = start + math.prod(shape) // block_size * block_bytes
        if end > len(self._data):
            raise GGUFFormatError(f"tensor {name!r} needs bytes {start}-{end} of a {len(self._data)}-byte file")
        return GGUFTensor(name, qtype, shape, self._data[start:end], start)

    def populated(self, tensors: list[GGUFTensor]) -> Iterator[GGUFTensor]:
        """The tensors in order, each with its pages mapped in: one background thread populates them
        ahead of the caller's decoding, so the page-table work (madvise is kernel time on one thread)
        overlaps the decode instead of preceding each tensor."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gguf-populate") as pool:
            futures = [pool.submit(self.populate, t) for t in tensors]
            try:
                for tensor, done in zip(tensors, futures):
                    done.result()
                    yield tensor
            finally:
                for future in futures:
                    future.cancel()

    def populate(self, tensor: GGUFTensor) -> None:
        """Map a tensor's pages in with one madvise, ahead of decoding it. Touching a fresh mapping
        faults page by page: decoding a 191 MB Q6_K embedding took 1.3x the CPU time that way (0.46
        against 0.36 s, warm page cache, on this project's VM). Kernels before 5.14 refuse the
        advice; the pages then fault in as they are read."""
        start = tensor.offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            self._map.madvise(_MADV_POPULATE_READ, start, tensor.offset + tensor.data.nbytes - start)
        except OSError:
            pass
