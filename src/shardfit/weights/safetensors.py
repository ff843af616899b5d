"""The header of a safetensors file and the byte range of any rows of its tensors (the file format: 8-byte
little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw row-major data).

A rank's rows of a tensor are one contiguous byte range, which the loader reads with os.preadv. Malformed files
raise ValueError, which the loader turns into an error naming the file.
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import torch

from shardfit.fsutil import safetensors_header

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class SafetensorsView:
    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._size = path.stat().st_size
        self.header, self._base = safetensors_header(self._file, self._size)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def byte_range(self, name: str, start: int | None = None, stop: int | None = None):
        """(file offset, byte count, dtype, shape) of rows [start, stop) along dim 0 (all of a 0-d tensor)."""
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"tensor '{name}' has dtype {info['dtype']}, which shardfit does not read")
        dtype, shape = _DTYPES[info["dtype"]], list(info["shape"])
        begin, end = info["data_offsets"]
        if shape:
            row = prod(shape[1:]) * dtype.itemsize
            start, stop = start or 0, shape[0] if stop is None else stop
            begin, end, shape = begin + start * row, begin + stop * row, [stop - start, *shape[1:]]
        if self._base + end > self._size:
            raise ValueError(f"tensor '{name}' runs past the end of the file (truncated?)")
        return self._base + begin, end - begin, dtype, shape

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()
