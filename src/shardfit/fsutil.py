"""Files that are complete or absent: write under a temporary name, then rename (atomic on POSIX). And the header of
a safetensors file, torch-free: the config loader reads a PEFT adapter's tensor names before torch is imported
(weights/peft_config.py); weights/safetensors.py reads the same header for the loader. And what a Hugging Face Hub
id looks like (ORG/NAME), for the paths users write one into (data/sources.py)."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import BinaryIO

# A Hugging Face Hub repository id, as users write one where a local path goes
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
    return path


def safetensors_header(f: BinaryIO, size: int) -> tuple[dict, int]:
    """(header {name: {dtype, shape, data_offsets}} without __metadata__, the data's first byte) of the safetensors
    file open as `f` (at its start), `size` bytes long; ValueError for a malformed one."""
    if size < 8:
        raise ValueError("file shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > size - 8:
        raise ValueError(f"header length {n} runs past the end of the file ({size} bytes)")
    header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n
