import enum
import os
import pickle

import pytest

from shardfit.safe_pickle import DCP_GLOBALS, RefusedGlobal, safe_loads


class Color(enum.Enum):
    RED = 1


def _getattr_pickle(module: str, qualname: str, attr: str) -> bytes:
    """A protocol-2 pickle of getattr(<module.qualname>, attr), as some Pythons write Enum members."""
    return (b"\x80\x02cbuiltins\ngetattr\nc" + module.encode() + b"\n" + qualname.encode() + b"\nX"
            + len(attr).to_bytes(4, "little") + attr.encode() + b"\x86R.")


def test_enum_members_by_getattr_are_admitted_and_nothing_else():
    data = _getattr_pickle(__name__, "Color", "RED")
    assert safe_loads(data, allowed=DCP_GLOBALS, modules=(__name__,)) is Color.RED
    with pytest.raises(RefusedGlobal, match="refused getattr"):  # getattr on a non-Enum: refused
        safe_loads(_getattr_pickle(__name__, "Color", "__class__"), allowed=DCP_GLOBALS, modules=(__name__,))
    with pytest.raises(RefusedGlobal, match="posix.system|os.system"):
        safe_loads(pickle.dumps(os.system))
    with pytest.raises(RefusedGlobal, match="builtins.getattr"):  # snapshots admit no getattr at all
        safe_loads(_getattr_pickle(__name__, "Color", "RED"))


@pytest.mark.parametrize("name", ["os", "torch", "field", "dataclass", "Any"])
def test_an_allowed_module_admits_only_the_classes_it_defines(name):
    """DCP's metadata module imports os, torch and dataclasses.field: a pickle naming them through it is refused."""
    data = b"\x80\x02ctorch.distributed.checkpoint.metadata\n" + name.encode() + b"\n."
    with pytest.raises(RefusedGlobal, match=name):
        safe_loads(data, allowed=DCP_GLOBALS, modules=("torch.distributed.checkpoint.metadata",))
    ok = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n."
    assert safe_loads(ok, allowed=DCP_GLOBALS, modules=("torch.distributed.checkpoint.metadata",)).__name__ == \
        "Metadata"


def test_a_huge_memo_index_is_refused_before_the_unpickler_allocates_for_it():
    """LONG_BINPUT 2**31 would make CPython's unpickler grow its memo table to 2**31 entries (16 GiB)."""
    import struct

    data = b"\x80\x02N" + b"r" + struct.pack("<I", 2**31) + b"."
    with pytest.raises(RefusedGlobal, match="memo index 2147483648"):
        safe_loads(data)
    assert safe_loads(pickle.dumps([[1], [1]])) == [[1], [1]]  # honest memo use still loads
