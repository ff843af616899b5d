"""What a checkpoint directory must hold before any loader touches it.

A shardfit checkpoint holds tensors only. DCP's own reader unpickles `.metadata` with plain pickle and loads a
"bytes" item with torch.load(weights_only=False): a crafted file would run code through either. So:
  - `read_metadata` unpickles `.metadata` through the allowlist (shardfit.safe_pickle) and checks its types;
  - `check_files` checks every file of a step directory (JSON records, config, RNG states, the byte range and
    torch.save framing of every tensor item) and says what is wrong, so that resume can fall back to an older one;
  - `check_against` compares the metadata with the state dict about to be loaded (every key present, a tensor of
    the same global shape and dtype, nothing declared as bytes);
  - `load_tensors` is the only way shardfit hands a checkpoint to DCP: through `TensorReader`, which reads the
    checked metadata and refuses bytes items outright.
Every check reads only headers and a few bytes per item: resume pays milliseconds, not a pass over the shards.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from shardfit.errors import ShardfitError
from shardfit.safe_pickle import DCP_GLOBALS, DCP_MODULES, RefusedGlobal, safe_loads

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

COMPLETE = "complete.json"
_ITEM_FILE = re.compile(r"^__\d+_\d+\.distcp$")  # DCP's names for the per-rank data files
_ZIP_HEAD, _ZIP_END = b"PK\x03\x04", b"PK\x05\x06"  # every tensor item is one torch.save zip archive
_CPU_RNG_BYTES = torch.get_rng_state().numel()


class CheckpointProblem(Exception):
    """What is wrong with a checkpoint file, naming the file (turned into a ShardfitError or a fallback)."""


def read_metadata(path: Path) -> Metadata:
    """DCP's .metadata, through the allowlisting unpickler, checked to be what DCP writes."""
    try:
        meta = safe_loads((path / ".metadata").read_bytes(), allowed=DCP_GLOBALS, modules=DCP_MODULES, dtypes=True)
    except FileNotFoundError:
        raise CheckpointProblem("missing .metadata") from None
    except RefusedGlobal as e:
        raise CheckpointProblem(f".metadata {e}") from None
    except Exception as e:  # truncated or garbled pickle
        raise CheckpointProblem(f".metadata is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict) \
            or not isinstance(meta.storage_data, dict):
        raise CheckpointProblem(".metadata is not a checkpoint index")
    for key, md in meta.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            raise CheckpointProblem(f".metadata declares '{key}' as pickled bytes (a shardfit checkpoint holds "
                                    "tensors only): refused, it would run code")
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointProblem(f".metadata entry '{key}' is not a tensor")
        # every chunk must say where its bytes are: DCP's reader would otherwise fail on a bare KeyError mid-load
        for i, chunk in enumerate(getattr(md, "chunks", None) or []):
            try:
                where = MetadataIndex(key, getattr(chunk, "offsets", None), i) in meta.storage_data
            except TypeError:  # an unhashable offsets value, from a garbled index
                where = False
            if not where:
                raise CheckpointProblem(f".metadata gives '{key}' chunk {i} no place in the data files")
    return meta


def _json_record(path: Path, name: str, step: int, keys: tuple[str, ...]) -> dict:
    try:
        rec = json.loads((path / name).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointProblem(f"missing {name}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointProblem(f"{name} is not JSON ({e})") from None
    if not isinstance(rec, dict):
        raise CheckpointProblem(f"{name} is not a JSON object")
    for k in keys:
        v = rec.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise CheckpointProblem(f"{name}: '{k}' is {v!r}, not a count")
    if rec["step"] != step:
        raise CheckpointProblem(f"{name} says step {rec['step']}, the directory step {step}")
    return rec


def _check_rng(path: Path, world: int) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    for r in range(world):
        f = path / "rng" / f"rank{r}.safetensors"
        try:
            rng = load_file(str(f))
        except FileNotFoundError:
            raise CheckpointProblem(f"missing rng/{f.name}") from None
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointProblem(f"rng/{f.name} is unreadable ({e})") from None
        cpu = rng.get("cpu")
        if cpu is None or cpu.dtype != torch.uint8 or cpu.shape != (_CPU_RNG_BYTES,) or any(
                v.dtype != torch.uint8 or v.dim() != 1 for v in rng.values()):
            raise CheckpointProblem(f"rng/{f.name} does not hold RNG states")


def _check_items(path: Path, meta: Metadata) -> None:
    """Every item's file exists, is long enough, and the item is framed as one torch.save archive."""
    by_file: dict[str, list] = {}
    for info in meta.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not _ITEM_FILE.match(rel):  # no '..', no '/': only the step's own files
            raise CheckpointProblem(f".metadata names data file {rel!r}, not one of this checkpoint's")
        off, n = getattr(info, "offset", None), getattr(info, "length", None)
        if not all(isinstance(v, int) and v >= 0 for v in (off, n)) or n < len(_ZIP_HEAD) + len(_ZIP_END):
            raise CheckpointProblem(f".metadata gives {rel} a bad byte range ({off!r}, {n!r})")
        by_file.setdefault(rel, []).append(info)
    for rel, infos in sorted(by_file.items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointProblem(f"missing {rel}")
        size, end = f.stat().st_size, max(i.offset + i.length for i in infos)
        if size < end:
            raise CheckpointProblem(f"{rel} is truncated ({size} of {end} bytes)")
        with open(f, "rb") as fh:
            for i in infos:
                if i.transform_descriptors:  # compressed by a DCP extension: not shardfit's, no framing to check
                    raise CheckpointProblem(f"{rel} holds transformed items (a DCP extension shardfit does not use)")
                fh.seek(i.offset)
                head = fh.read(len(_ZIP_HEAD))
                fh.seek(i.offset + i.length - 22)  # a zip without a comment ends with its 22-byte end record
                if head != _ZIP_HEAD or fh.read(4) != _ZIP_END:
                    raise CheckpointProblem(f"{rel} is corrupt at byte {i.offset} (not a saved tensor)")


def check_files(path: Path) -> str | None:
    """None if the step directory is whole, else what is wrong with it (naming the file)."""
    m = re.match(r"^step_(\d{8})$", path.name)
    step = int(m.group(1)) if m else -1
    try:
        done = _json_record(path, COMPLETE, step, ("step", "world_size"))
        _json_record(path, "trainer.json", step, ("step", "world_size", "skipped", "tokens_seen"))
        if done["world_size"] < 1:
            raise CheckpointProblem(f"{COMPLETE}: world_size {done['world_size']}")
        config_toml(path)
        _check_rng(path, done["world_size"])
        _check_items(path, read_metadata(path))
    except CheckpointProblem as e:
        return str(e)
    except OSError as e:  # unreadable (permissions, a directory where a file belongs)
        return f"unreadable ({e.strerror or e}: {Path(e.filename or '').name})"
    return None


def config_toml(path: Path) -> dict:
    """The run's config saved with the checkpoint, parsed."""
    try:
        return tomllib.loads((path / "config.toml").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointProblem("missing config.toml") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointProblem(f"config.toml is not TOML ({e})") from None


def _flat(state: dict, prefix: str = "") -> dict[str, object]:
    """DCP's flattened keys: nested dicts joined with '.' ({"optim": {"w": {"exp_avg": t}}} -> "optim.w.exp_avg")."""
    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def check_against(meta: Metadata, state: dict, path: Path, cast: bool = False) -> None:
    """Every tensor about to be loaded is in the checkpoint with the same global shape and dtype (cast: a floating
    dtype may differ from another floating one; DCP's reader copies each stored tensor into its target, casting)."""
    for key, want in _flat(state).items():
        if not isinstance(want, torch.Tensor):
            continue  # DCP loads only tensors into a state dict of tensors (an int step would stay as it is)
        md = meta.state_dict_metadata.get(key)
        if md is None:
            raise ShardfitError(f"the checkpoint has no '{key}': it was saved from another model or optimizer",
                                where=str(path), fix="resume with the model config it was saved with, or start a "
                                "new run (another logging.run_dir)")
        have = tuple(md.size)
        castable = cast and md.properties.dtype.is_floating_point and want.dtype.is_floating_point
        if have != tuple(want.shape) or (md.properties.dtype != want.dtype and not castable):
            raise ShardfitError(f"a checkpoint of another model shape: '{key}' is {list(have)} "
                                f"{md.properties.dtype} there, {list(want.shape)} {want.dtype} here",
                                where=str(path), fix="resume with the model config it was saved with, or start a "
                                "new run (another logging.run_dir)")
        covered = sum(math.prod(c.sizes) for c in md.chunks)
        if covered < math.prod(have):
            raise ShardfitError(f"'{key}' is incomplete in the checkpoint ({covered} of {math.prod(have)} "
                                "elements)", where=str(path), fix="resume from an earlier checkpoint")


class TensorReader(FileSystemReader):
    """DCP's file reader that reads .metadata through the allowlist (or is handed the index already read and
    checked, which DCP then uses as it is: no second parse, nothing swapped in between) and never loads a bytes
    item."""

    def __init__(self, path, meta: Metadata | None = None):
        super().__init__(path)
        self.checked_meta = meta

    def read_metadata(self, *args, **kwargs) -> Metadata:
        meta = self.checked_meta if self.checked_meta is not None else read_metadata(Path(self.path))
        if getattr(meta, "storage_meta", None) is None and hasattr(dcp.metadata, "StorageMeta"):
            meta.storage_meta = dcp.metadata.StorageMeta()
        if getattr(meta, "storage_meta", None) is not None:
            meta.storage_meta.load_id = self.load_id
        return meta

    def read_data(self, plan, planner):
        from torch.distributed.checkpoint.planner import LoadItemType

        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            raise CheckpointProblem("the load plan holds a bytes item: refused")
        return super().read_data(plan, planner)


def load_tensors(state: dict, path: Path, cast: bool = False) -> None:
    """dcp.load of `state` from the step directory `path`, after the checks; a read that fails anyway (a flipped
    byte inside a tensor's archive) is one line naming the checkpoint, raised on every rank alike (DCP gathers
    each rank's failure before raising)."""
    try:
        meta = read_metadata(path)
        _check_items(path, meta)  # again: a caller may not have run check_files, and it costs a few reads
    except CheckpointProblem as e:
        raise ShardfitError(f"corrupt checkpoint: {e}", where=str(path),
                            fix="resume from an earlier checkpoint (checkpoint.resume=auto skips corrupt ones)"
                            ) from None
    check_against(meta, state, path, cast)
    try:
        dcp.load(state, storage_reader=TensorReader(path, meta))
    except CheckpointException as e:  # every rank's failure, gathered by DCP and raised on all ranks alike
        rank, (err, _trace) = min(e.failures.items())
        # what a damaged file can raise inside DCP's reader (KeyError, IndexError: an index that does not match the
        # files); anything else is a bug of ours and propagates
        if not isinstance(err, (CheckpointProblem, OSError, RuntimeError, ValueError, KeyError, IndexError,
                                pickle.UnpicklingError)):
            raise
        raise ShardfitError(f"corrupt checkpoint: rank {rank} could not read it ({type(err).__name__}: "
                            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''})", where=str(path),
                            fix="resume from an earlier checkpoint (checkpoint.resume=<step dir>)") from err
