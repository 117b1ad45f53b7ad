"""A GGUF file's header read straight off a memory map: metadata values and the tensor table.

gguf's own `GGUFReader` builds a numpy view for every part of every metadata field, which for a
150K-token vocabulary (tokens, scores, token types, merges: ~600K parts) takes tens of seconds
and is the larger part of a GGUF load. Here the header is walked with `struct` once; string arrays
are skipped (only their count kept) unless asked for by key, and number arrays are one
`np.frombuffer` each; the map is closed after the header. Tensor data is read with positioned
reads (`FileRows`: indexing an outer dim reads just those rows into fresh memory, in the layout
gguf's reader gives: values for F32 / F16, bytes [..., rows, row bytes] for the block types and
BF16), so a rank reads only the rows and experts it keeps, and nothing of the file stays resident
(a memory map's touched pages count in the process's RSS until the map is dropped).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")
DEFAULT_ALIGNMENT = 32  # llama.cpp's, when general.alignment is absent


class GGUFError(ValueError):
    pass


# ---- which files --------------------------------------------------------------------------------
def is_gguf(model: str | None) -> bool:
    """A .gguf file, or a directory holding one and no config.json."""
    if model is None:
        return False
    if os.path.isfile(model):
        return model.endswith(".gguf")
    if os.path.isdir(model) and not os.path.exists(os.path.join(model, "config.json")):
        return any(n.endswith(".gguf") for n in os.listdir(model))
    return False


def gguf_files(model: str) -> list[str]:
    """Every part of the model: one file, or all parts of a split set (named by any part)."""
    if os.path.isdir(model):
        names = sorted(n for n in os.listdir(model) if n.endswith(".gguf"))
        firsts = [n for n in names if not SPLIT.match(n) or SPLIT.match(n).group(2) == "00001"]
        if len(firsts) != 1:
            raise GGUFError(f"directory {model!r} holds {len(firsts)} GGUF models ({firsts}); name the file")
        model = os.path.join(model, firsts[0])
    m = SPLIT.match(os.path.basename(model))
    if not m:
        return [model]
    base, count = os.path.join(os.path.dirname(model), m.group(1)), int(m.group(3))
    parts = [f"{base}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [p for p in parts if not os.path.exists(p)]
    if missing:
        raise GGUFError(f"split GGUF {model!r}: missing parts {missing}")
    return parts


# ---- the header ---------------------------------------------------------------------------------
# metadata value types (gguf's GGUFValueType): fixed-size scalars, then string (8) and array (9)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
# tensor types stored as values (gguf's reader gives these as typed arrays, the rest as bytes)
_VALUES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
           "I32": np.int32, "I64": np.int64}  # fmt: skip


class FileRows:
    """A tensor's bytes in the file as an array-like [outer, ...] of `dtype`: `rows[i]` is the
    sub-array of one outer index (an expert), `rows[a:b]` reads those outer rows with one positioned
    read into a fresh writable array, `np.asarray(rows)` reads it all."""

    def __init__(self, fd: int, offset: int, shape: tuple[int, ...], dtype: Any) -> None:
        self.fd, self.offset, self.shape, self.dtype = fd, offset, tuple(shape), np.dtype(dtype)
        inner = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
        self.stride = inner * self.dtype.itemsize  # bytes per outer index
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def _read(self, at: int, shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, self.dtype)
        self._fill(at, out)
        return out

    def _fill(self, at: int, out: np.ndarray) -> None:
        view, done = memoryview(out.reshape(-1).view(np.uint8)), 0
        while done < len(view):  # one call reads at most ~2 GiB
            n = os.preadv(self.fd, [view[done:]], at + done)
            if n <= 0:
                raise GGUFError(f"short read at byte {at + done} (the file shrank?)")
            done += n

    def mapped(self, a: int, b: int) -> np.ndarray:
        """Outer rows [a, b), read-only, on a mapping of just their pages (populated at once): a
        kernel reads them from the page cache with no copy into an array of ours (first touch of
        fresh memory is what a load spends most on); unmapped when the array is dropped."""
        at = self.offset + a * self.stride
        start = at - at % mmap.ALLOCATIONGRANULARITY
        size = at - start + (b - a) * self.stride
        m = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      prot=mmap.PROT_READ, offset=start)  # fmt: skip
        count = (b - a) * self.stride // self.dtype.itemsize
        return np.frombuffer(m, self.dtype, count, at - start).reshape(b - a, *self.shape[1:])

    def read_into(self, a: int, out: np.ndarray) -> None:
        """Outer rows [a, a + len(out)) straight into `out` (contiguous, writable, their bytes'
        size): an embedding or head stored in the model dtype, with no array of its own between."""
        if out.nbytes != len(out) * self.stride or not out.flags.c_contiguous or a + len(out) > self.shape[0]:
            raise ValueError(f"read_into: rows [{a}, {a + len(out)}) of {self.shape} into {out.shape}")
        self._fill(self.offset + a * self.stride, out)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (int, np.integer)):
            i = int(index) + (self.shape[0] if index < 0 else 0)
            if not 0 <= i < self.shape[0]:
                raise IndexError(index)
            if self.ndim == 1:
                return self._read(self.offset + i * self.stride, ())[()]
            return FileRows(self.fd, self.offset + i * self.stride, self.shape[1:], self.dtype)
        if isinstance(index, slice) and index.step in (None, 1):
            a, b, _ = index.indices(self.shape[0])
            b = max(a, b)
            return self._read(self.offset + a * self.stride, (b - a, *self.shape[1:]))
        raise TypeError(f"FileRows takes an index or a plain slice, not {index!r}")

    def columns(self, a: int, b: int, c0: int, c1: int) -> np.ndarray:
        """Rows [a, b) of a 2-D tensor, only their entries [c0, c1) of the last axis (a TP rank's
        inputs; for block types the bytes of its blocks): one positioned read per row where that
        skips at least one whole page of each row (the page cache reads whole pages, so a shorter
        skip saves no reading), else the rows whole, cut (a fresh array either way)."""
        if self.ndim != 2:
            raise ValueError(f"FileRows.columns reads a 2-D tensor, not {self.shape}")
        b, c1 = max(a, b), max(c0, c1)
        width, item = self.shape[1], self.dtype.itemsize
        if (c0, c1) == (0, width):
            return self[a:b]
        if (width - (c1 - c0)) * item < 2 * mmap.PAGESIZE:
            return np.ascontiguousarray(self[a:b][:, c0:c1])
        out = np.empty((b - a, c1 - c0), self.dtype)
        flat = out.view(np.uint8).reshape(b - a, -1)
        for r in range(b - a):
            at, view, done = self.offset + (a + r) * self.stride + c0 * item, memoryview(flat[r]), 0
            while done < len(view):
                n = os.preadv(self.fd, [view[done:]], at + done)
                if n <= 0:
                    raise GGUFError(f"short read at byte {at + done} (the file shrank?)")
                done += n
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self._read(self.offset, self.shape)
        return out if dtype is None else out.astype(dtype)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its ggml type, its shape in numpy / HF order, its bytes in the map."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # outermost first ([experts, out, in]): reversed from the file's order
    data: FileRows  # the tensor's bytes in the file (see the module doc for its layout)


class GGUFFile:
    """One GGUF file: `metadata` {key: value} and `tensors` [TensorInfo] (the header walked on a
    memory map, closed after). String arrays not named in `string_arrays` are read as their length."""

    def __init__(self, path: str, string_arrays: tuple[str, ...] = ()) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self._parse(path, string_arrays)
        except BaseException:
            os.close(self.fd)
            raise

    def _parse(self, path: str, string_arrays: tuple[str, ...]) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        size = os.fstat(self.fd).st_size
        if size < 24:
            raise GGUFError(f"{path}: not a readable GGUF file ({size} bytes)")
        with mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ) as buf:
            self._walk(path, buf, string_arrays, GGML_QUANT_SIZES, GGMLQuantizationType, size)
        self._buf = None

    def _walk(
        self, path: str, buf: Any, string_arrays: tuple, sizes: Any, types: Any, file_size: int
    ) -> None:
        if buf[:4] != b"GGUF":
            raise GGUFError(f"{path}: not a readable GGUF file (no GGUF magic at its start)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version}; versions 2 and 3 are read")
        self._buf, self._pos = buf, 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype, key in string_arrays)
        table = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            qtype, offset = self._unpack("<IQ")
            table.append((name, tuple(int(d) for d in reversed(dims)), qtype, offset))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._pos // align) * align
        self.tensors: list[TensorInfo] = []
        for name, shape, qtype, offset in table:
            kind = types(qtype)
            block, size = sizes[kind]
            count = int(np.prod(shape)) if shape else 1
            at = start + offset
            if at + count // block * size > file_size:
                raise GGUFError(f"{path}: tensor {name!r} runs past the end of the file (truncated?)")
            if kind.name in _VALUES:
                data = FileRows(self.fd, at, shape, _VALUES[kind.name])
            else:  # blocks (and BF16, a block of one value): bytes [..., rows, bytes of a row]
                data = FileRows(self.fd, at, (*shape[:-1], shape[-1] // block * size), np.uint8)
            self.tensors.append(TensorInfo(name, kind, shape, data))

    def close(self) -> None:
        os.close(self.fd)

    # the walk: each read advances self._pos
    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        s = self._buf[self._pos + 8 : self._pos + 8 + n].decode("utf-8", errors="replace")
        self._pos += 8 + n
        return s

    def _value(self, vtype: int, keep: bool) -> Any:
        if vtype in _SCALAR:
            return self._unpack("<" + _SCALAR[vtype])[0]
        if vtype == 8:
            return self._string()
        if vtype != 9:
            raise GGUFError(f"{self.path}: metadata value of unknown type {vtype}")
        etype, count = self._unpack("<IQ")
        if etype in _NUMPY:  # numbers: one view, copied off the map (token types, scores, sections)
            dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
            values = np.frombuffer(self._buf, dt, count, self._pos).copy()
            self._pos += count * dt.itemsize
            return values.tolist() if count <= 64 else values
        if etype == 8:
            if keep:
                return [self._string() for _ in range(count)]
            buf, pos = self._buf, self._pos
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):  # variable lengths: nothing to do but walk them
                pos += 8 + unpack(buf, pos)[0]
            self._pos = pos
            return count
        return [self._value(etype, keep) for _ in range(count)]  # arrays of arrays: rare, small


_OPEN: dict[tuple, GGUFFile] = {}


def open_file(path: str, string_arrays: tuple[str, ...] = ()) -> GGUFFile:
    """The file's header, read once a process (per set of string arrays asked for)."""
    key = (os.path.abspath(path), os.path.getsize(path), os.path.getmtime(path), string_arrays)
    if key not in _OPEN:
        try:
            _OPEN[key] = GGUFFile(path, string_arrays)
        except GGUFError:
            raise
        except Exception as exc:
            raise GGUFError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    return _OPEN[key]
