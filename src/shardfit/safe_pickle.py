"""Unpickling that runs no code: only the globals on an explicit allowlist may be named.

Plain `pickle.load` imports and calls whatever the file names (os.system included). Memory snapshots hold only
plain containers; DCP's `.metadata` holds a few of its own dataclasses. Anything else is refused before it runs.
"""

from __future__ import annotations

import enum
import io
import pickle


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a Python global outside the allowlist: it would have imported or called code."""


def _torch_dtype(module: str, name: str) -> bool:
    if module != "torch":
        return False
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


# Containers some PyTorch versions emit in memory snapshots.
SNAPSHOT_GLOBALS = frozenset({("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")})
# What torch.distributed.checkpoint writes into .metadata (torch 2.6-2.13), besides dtypes.
DCP_GLOBALS = SNAPSHOT_GLOBALS | {
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path")}
DCP_MODULES = ("torch.distributed.checkpoint.metadata",)


def _enum_member(cls, name: str):
    """The only getattr a pickle may call: an Enum member by name (some Python versions pickle members as
    getattr(EnumClass, 'NAME')). Anything else would let a pickle walk attributes towards code."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
        return cls.__members__[name]
    raise RefusedGlobal(f"refused getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r})")


class SafeUnpickler(pickle.Unpickler):
    def __init__(self, file, allowed=SNAPSHOT_GLOBALS, modules: tuple[str, ...] = (), dtypes: bool = False):
        super().__init__(file)
        self.allowed, self.modules, self.dtypes = allowed, modules, dtypes

    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr") and self.modules:
            return _enum_member
        if name.startswith("__"):
            raise RefusedGlobal(f"refused to load global '{module}.{name}'")
        if (module, name) in self.allowed or (self.dtypes and _torch_dtype(module, name)):
            return super().find_class(module, name)
        if module in self.modules:
            # Only the classes the module defines: its namespace also holds what it imported (os, torch,
            # dataclasses.field), which a pickle must not reach.
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:
                return found
        raise RefusedGlobal(f"refused to load global '{module}.{name}'")


def _check_memo(data: bytes) -> None:
    """Refuse memo indices no honest pickle reaches: CPython's unpickler grows its memo table to the index a PUT
    names, so one opcode could make it allocate gigabytes. An honest index counts the objects stored before it,
    fewer than the pickle's bytes. pickletools walks the opcodes without building anything."""
    import pickletools

    try:
        for op, arg, _pos in pickletools.genops(data):
            if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET") and \
                    (not isinstance(arg, int) or arg > len(data)):
                raise RefusedGlobal(f"refused memo index {arg} in a pickle of {len(data)} bytes")
    except ValueError as e:  # truncated or garbled: the unpickler would refuse it too, say so here
        raise pickle.UnpicklingError(str(e)) from None


def safe_loads(data: bytes, **allow):
    _check_memo(data)
    return SafeUnpickler(io.BytesIO(data), **allow).load()
