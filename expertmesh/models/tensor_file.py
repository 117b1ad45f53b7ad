"""A safetensors file read with positioned reads, not a memory map: loading in one pass.

`safe_open` maps the whole file; every page a rank's slices touch then stays resident in the
process (its RSS) until the file is closed, so loading a checkpoint peaked at about the weights
twice (docs/benchmarks.md, "Dispatch figures"). Here each tensor slice is read with `pread` into
its own buffer, copied into the parameter and released before the next: what stays resident is
the parameters (the page cache holds the file, outside the process).

The interface is the part of safe_open's the loader uses: `keys()`, `get_slice(key)` with
`get_shape()`, `get_dtype()` and indexing by slices. A slice of the leading dim reads just those
rows; other dims are cut after the read (e.g. a row-parallel rank reads whole rows, keeps its
columns, and the buffer is dropped at once).
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


class TensorFileError(OSError):
    pass


class TensorFile:
    """One open .safetensors file (a context manager, like safe_open)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self.header, self.data_start = self._read_header()
        except Exception:
            os.close(self.fd)
            raise

    def _read_header(self) -> tuple[dict, int]:
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, 8, 0)
        if len(head) < 8:
            raise TensorFileError(f"{self.path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise TensorFileError(f"{self.path}: header of {n} bytes in a file of {size} (truncated?)")
        try:
            header = json.loads(os.pread(self.fd, n, 8))
        except ValueError as exc:
            raise TensorFileError(f"{self.path}: the safetensors header is not JSON ({exc})") from exc
        header.pop("__metadata__", None)
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if 8 + n + end > size:
            raise TensorFileError(
                f"{self.path}: tensors end at byte {8 + n + end}, the file at {size} (truncated)"
            )
        for key, v in header.items():
            if v["dtype"] not in DTYPES:
                raise TensorFileError(f"{self.path}: tensor {key!r} has dtype {v['dtype']}, not supported")
        return header, 8 + n

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)

    def keys(self) -> list[str]:
        return list(self.header)

    def get_slice(self, key: str) -> StoredTensor:
        if key not in self.header:
            raise KeyError(f"{self.path} has no tensor {key!r}")
        return StoredTensor(self, key, self.header[key])


class StoredTensor:
    def __init__(self, file: TensorFile, key: str, entry: dict) -> None:
        self.file, self.key = file, key
        self.dtype_name, self.shape = entry["dtype"], tuple(entry["shape"])
        self.offset = file.data_start + entry["data_offsets"][0]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype_name

    def _read(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the leading dim (the whole tensor for a scalar)."""
        dtype = DTYPES[self.dtype_name]
        rest = self.shape[1:]
        row = math.prod(rest) * torch.empty((), dtype=dtype).element_size()
        count = (stop - start) if self.shape else 1
        buf = torch.empty(count * row if self.shape else row, dtype=torch.uint8)
        view, done, at = memoryview(buf.numpy()), 0, self.offset + start * row
        while done < len(view):
            got = os.preadv(self.file.fd, [view[done:]], at + done)
            if got <= 0:
                raise TensorFileError(f"{self.file.path}: short read of tensor {self.key!r}")
            done += got
        out = buf.view(dtype)
        return out.view(self.shape[:0] if not self.shape else (count, *rest))

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if not self.shape:
            return self._read(0, 1)
        first = index[0] if index else slice(None)
        if isinstance(first, int):
            first = slice(first, first + 1)
            squeeze = True
        else:
            squeeze = False
        start, stop, step = first.indices(self.shape[0])
        if step != 1:
            raise TypeError(f"tensor {self.key!r}: slices with a step are not supported")
        t = self._read(start, max(start, stop))
        rest = index[1:]
        if rest:
            t = t[(slice(None), *rest)]
        t = t[0] if squeeze else t
        return t.clone() if rest else t  # a cut of the read buffer: keep only what was asked for
