import os

import pytest
import torch
from safetensors.torch import save_file

from shardfit.weights.safetensors import SafetensorsView

TENSORS = {"a": torch.randn(7, 5).bfloat16(), "b": torch.randn(3), "c": torch.tensor(2.5), "e": torch.empty(0, 4),
           "i": torch.arange(10), "x": torch.randn(4, 3, 2).half()}


@pytest.fixture
def view(tmp_path):
    save_file(TENSORS, str(tmp_path / "x.safetensors"))
    v = SafetensorsView(tmp_path / "x.safetensors")
    yield v
    v.close()


def _read(view, name, start=None, stop=None):
    offset, nbytes, dtype, shape = view.byte_range(name, start, stop)
    raw = os.pread(view.fileno(), nbytes, offset)
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)


def test_byte_range_of_every_dtype_and_rows(view):
    """The loader reads byte_range with os.preadv: it must be exactly those rows of the tensor."""
    for name, t in TENSORS.items():
        assert torch.equal(_read(view, name), t), name
    for name, start, stop in (("a", 2, 5), ("x", 1, 4), ("x", 1, 3), ("i", 9, 10)):
        assert torch.equal(_read(view, name, start, stop), TENSORS[name][start:stop]), name


def test_truncated_and_malformed_files(tmp_path):
    save_file(TENSORS, str(tmp_path / "x.safetensors"))
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:-20])
    v = SafetensorsView(tmp_path / "t.safetensors")
    last = max(v.header, key=lambda k: v.header[k]["data_offsets"][1])  # the tensor the truncation cut
    with pytest.raises(ValueError, match="runs past the end"):
        v.byte_range(last)
    v.close()
    (tmp_path / "h.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header length"):
        SafetensorsView(tmp_path / "h.safetensors")
