"""Issue 22, classes 1 and 4: a crafted checkpoint runs no code, a damaged one is never loaded.

One real two-checkpoint run (steps 2 and 4) is made once; each case damages a copy of step 4 and checks that
  - the damage is named (the file, what is wrong) by the check resume and `generate` run first;
  - checkpoint.resume=auto falls back to step 2 and says which it passed over;
  - an explicit resume of the damaged step is one ShardfitError naming it;
  - nothing ran (the planted pickles would create a marker file) and step 2 is byte for byte as it was.
A hypothesis test then mutates the bytes of any file of the checkpoint at random.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardfit.errors import ShardfitError
from shardfit.models import build_model
from shardfit.weights.checkpoint import resolve_resume
from shardfit.weights.checkpoint_verify import check_files, load_tensors
from tests._dist import run_ranks
from tests.helpers import small_config

MARKER = "pwned"


def _two_checkpoints(rank, world, root):
    from shardfit.train import Trainer

    Trainer(small_config("--train.steps=4", "--checkpoint.every=2", "--checkpoint.final=true", run_dir=root)).fit()
    return {}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trust")
    run_ranks(_two_checkpoints, 1, str(root / "run"))
    return root / "run" / "checkpoints"


def _digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


class _Touch:
    """Unpickled by plain pickle, it would create the marker file: what a crafted checkpoint would run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _metadata(d: Path):
    return pickle.loads((d / ".metadata").read_bytes())  # our own fresh file: trusted here, in the test


def _bytes_item(d: Path) -> None:
    """Declare a model tensor as a bytes item whose payload is a pickle: DCP would torch.load it unrestricted."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta = _metadata(d)
    key = "model.model.norm.weight"
    meta.state_dict_metadata[key] = BytesStorageMetadata()
    payload = pickle.dumps(_Touch(str(d.parent / MARKER)))
    (d / "__0_1.distcp").write_bytes(payload)
    meta.storage_data = {i: s for i, s in meta.storage_data.items() if i.fqn != key}
    meta.storage_data[MetadataIndex(key)] = _StorageInfo("__0_1.distcp", 0, len(payload))
    (d / ".metadata").write_bytes(pickle.dumps(meta))


def _rewrite_metadata(fn):
    def damage(d: Path) -> None:
        meta = _metadata(d)
        fn(meta)
        (d / ".metadata").write_bytes(pickle.dumps(meta))
    return damage


def _escape_path(meta) -> None:
    index = next(iter(meta.storage_data))
    meta.storage_data[index].relative_path = "../../../etc/passwd"


def _orphan_chunk(meta) -> None:  # a byte flip in a storage key's name: its chunk has no place (CI found it)
    index = next(k for k in meta.storage_data if k.fqn == "model.model.norm.weight")
    meta.storage_data[type(index)("model.model.norn.weight", index.offset, index.index)] = meta.storage_data.pop(index)


def _shard(d: Path) -> Path:
    return sorted(d.glob("*.distcp"))[0]


def _write(name: str, data: bytes):
    return lambda d: (d / name).write_bytes(data)


def _module_global(d: Path) -> None:  # a global reached through an allowed module's namespace (its `os` import)
    (d / ".metadata").write_bytes(b"\x80\x02ctorch.distributed.checkpoint.metadata\nos\n.")


def _as_directory(name: str):
    def damage(d: Path) -> None:
        (d / name).unlink()
        (d / name).mkdir()
    return damage


def _float_rng(d: Path) -> None:
    from safetensors.torch import save_file

    save_file({"cpu": torch.zeros(3)}, str(d / "rng" / "rank0.safetensors"))


# (damage, what the check must say): more cases than the issue names, one per way a file can be wrong
CASES = {
    "bytes item (code)": (_bytes_item, "declares 'model.model.norm.weight' as pickled bytes"),
    "metadata runs a command": (_write(".metadata", pickle.dumps(_Touch("MARKER"))), "refused to load global"),
    "metadata reaches os via an allowed module": (_module_global, "refused to load global"),
    "data file outside the checkpoint": (_rewrite_metadata(_escape_path), "not one of this checkpoint's"),
    "a chunk with no place": (_rewrite_metadata(_orphan_chunk),
                              ".metadata gives 'model.model.norm.weight' chunk 0 no place"),
    "shard zeroed at full size": (lambda d: _shard(d).write_bytes(bytes(_shard(d).stat().st_size)),
                                  "is corrupt at byte 0"),
    "shard of random bytes": (lambda d: _shard(d).write_bytes(os.urandom(_shard(d).stat().st_size)),
                              "is corrupt at byte 0"),
    "shard truncated": (lambda d: _shard(d).write_bytes(_shard(d).read_bytes()[:1000]), "is truncated"),
    "shard missing": (lambda d: _shard(d).unlink(), "missing __0_0.distcp"),
    "metadata empty": (_write(".metadata", b""), ".metadata is unreadable"),
    "metadata not an index": (_write(".metadata", pickle.dumps({"a": 1})), "not a checkpoint index"),
    "metadata a directory": (_as_directory(".metadata"), "unreadable"),
    "trainer.json empty": (_write("trainer.json", b""), "trainer.json is not JSON"),
    "trainer.json a list": (_write("trainer.json", b"[1, 2]"), "trainer.json is not a JSON object"),
    "trainer.json step a string": (_write("trainer.json", b'{"step": "4", "world_size": 1, "skipped": 0, '
                                          b'"tokens_seen": 0}'), "'step' is '4', not a count"),
    "trainer.json of another step": (_write("trainer.json", b'{"step": 3, "world_size": 1, "skipped": 0, '
                                            b'"tokens_seen": 0}'), "says step 3, the directory step 4"),
    "trainer.json negative count": (_write("trainer.json", b'{"step": 4, "world_size": 1, "skipped": -1, '
                                           b'"tokens_seen": 0}'), "'skipped' is -1"),
    "complete.json garbage": (_write("complete.json", b"\xff\xfe"), "complete.json is not JSON"),
    "config.toml missing": (lambda d: (d / "config.toml").unlink(), "missing config.toml"),
    "config.toml not TOML": (_write("config.toml", b"[model\nname = "), "config.toml is not TOML"),
    "rng file garbage": (_write("rng/rank0.safetensors", b"\x00" * 64), "rng/rank0.safetensors is unreadable"),
    "rng file of other tensors": (_float_rng, "does not hold RNG states"),
    "rng file missing": (lambda d: (d / "rng" / "rank0.safetensors").unlink(), "missing rng/rank0.safetensors"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_checkpoint_is_named_and_passed_over(made, tmp_path, case):
    damage, needle = CASES[case]
    root = tmp_path / "checkpoints"
    shutil.copytree(made, root)
    before = _digest(root / "step_00000002")
    damage(root / "step_00000004")
    problem = check_files(root / "step_00000004")
    assert problem is not None and needle in problem, problem
    skipped: list[str] = []
    assert resolve_resume("auto", root, skipped) == root / "step_00000002"
    assert skipped == [f"skipped corrupt checkpoint {root / 'step_00000004'}: {problem}"]
    with pytest.raises(ShardfitError, match="corrupt checkpoint") as e:
        resolve_resume(str(root / "step_00000004"), root)
    assert str(root / "step_00000004") in str(e.value)
    # the tensor loader refuses damaged tensor files on its own too (a caller that skipped the check); damage to
    # the other files is not its business: the tensors then load
    model = build_model(small_config().model)
    tensor_files = needle.startswith((".metadata", "declares", "refused", "not one", "is corrupt", "is truncated",
                                      "missing __", "not a checkpoint", "unreadable"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            load_tensors({"model": model.state_dict()}, root / "step_00000004")
            assert not tensor_files, "damaged tensor files loaded"
        except ShardfitError as e:
            assert tensor_files and "corrupt checkpoint" in str(e), str(e)
    assert not list(tmp_path.rglob(MARKER)) and not Path("MARKER").exists()
    assert _digest(root / "step_00000002") == before and check_files(root / "step_00000002") is None


def test_checkpoint_of_another_model_shape_is_refused_with_the_key(made):
    wider = build_model(small_config("--model.dim=32", "--model.n_heads=2", "--model.n_kv_heads=1").model)
    with pytest.raises(ShardfitError, match=r"another model shape: 'model\.model\.embed_tokens\.weight' is "
                                            r"\[264, 64\] torch.float32 there, \[264, 32\]"):
        load_tensors({"model": wider.state_dict()}, made / "step_00000004")
    deeper = build_model(small_config("--model.n_layers=3").model)
    with pytest.raises(ShardfitError, match=r"has no 'model\.model\.layers\.2\."):
        load_tensors({"model": deeper.state_dict()}, made / "step_00000004")


_FILES = [".metadata", "__0_0.distcp", "trainer.json", "complete.json", "config.toml", "rng/rank0.safetensors"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(_FILES), how=st.sampled_from(["flip", "truncate", "replace", "zero"]),
       where=st.floats(0, 1), blob=st.binary(max_size=64))
def test_any_damage_to_any_file_is_refused_or_harmless(made, tmp_path, name, how, where, blob):
    """Whatever happens to a file's bytes: no exception but ShardfitError, nothing runs, the older checkpoint is
    untouched, and resume=auto ends on a whole checkpoint (bit flips inside tensor data are not detected: there
    is no checksum pass at resume, they load as they are)."""
    root = tmp_path / f"c{os.getpid()}_{abs(hash((name, how, where, blob)))}"
    shutil.copytree(made, root)
    before = _digest(root / "step_00000002")
    f = root / "step_00000004" / name
    data = bytearray(f.read_bytes())
    i = min(int(where * len(data)), len(data) - 1)
    if how == "flip":
        data[i] ^= 0xFF
    elif how == "truncate":
        data = data[:i]
    elif how == "replace":
        data[i:i + len(blob)] = blob
    else:
        data[i:] = bytes(len(data) - i)
    f.write_bytes(bytes(data))
    chosen = resolve_resume("auto", root, [])
    assert chosen in (root / "step_00000002", root / "step_00000004")
    model = build_model(small_config().model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            load_tensors({"model": model.state_dict()}, chosen)
        except ShardfitError:
            assert chosen == root / "step_00000004"
    assert not list(tmp_path.rglob(MARKER))
    assert _digest(root / "step_00000002") == before
    shutil.rmtree(root)


def test_unpickler_input_is_never_plain_pickle(made):
    """The reader DCP is given reads .metadata through the allowlist: a planted global fails in it, not later."""
    from shardfit.weights.checkpoint_verify import CheckpointProblem, TensorReader

    d = made.parent / "reader_case"
    shutil.copytree(made / "step_00000004", d)
    (d / ".metadata").write_bytes(pickle.dumps(_Touch(str(d / MARKER))))
    with pytest.raises(CheckpointProblem, match="refused"):
        TensorReader(d).read_metadata()
    assert not (d / MARKER).exists()


def _word_tokenizer(path: Path, n: int) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return path


def _config_with(key: str, value: str):
    def damage(d: Path) -> None:
        text = (d / "config.toml").read_text()
        lines = [f"{key} = {value}" if line.split(" = ")[0] == key else line for line in text.splitlines()]
        (d / "config.toml").write_text("\n".join(lines) + "\n")
    return damage


# shardfit generate on a checkpoint: (damage to a copy of step 4, extra flags, what the one line must say)
GENERATE_CASES = {
    "run directory whose checkpoints lack their config": (lambda d: (d / "config.toml").unlink(), [], "run",
                                                           "no complete checkpoint here (skipped corrupt checkpoint"),
    "step directory without its config": (lambda d: (d / "config.toml").unlink(), [], "step",
                                          "corrupt checkpoint: missing config.toml"),
    "config with a string for a count": (_config_with("dim", '"wide"'), [], "step", "config.toml [model] dim"),
    "config of another shape": (_config_with("n_layers", "3"), [], "step", "has no 'model.model.layers.2."),
    "tokenizer larger than the model": (lambda d: None, ["--tokenizer", "TOKENIZER"], "step",
                                        "the tokenizer has 400 tokens, the model 264"),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generate_on_a_bad_checkpoint_says_one_line(made, tmp_path, case):
    from shardfit.cli.generate import generate as generate_main

    damage, flags, given, needle = GENERATE_CASES[case]
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(made, root)
    shutil.rmtree(root / "step_00000002")
    damage(root / "step_00000004")
    tok = str(_word_tokenizer(tmp_path / "tokenizer.json", 400))
    target = str(tmp_path / "run") if given == "run" else str(root / "step_00000004")
    with pytest.raises(ShardfitError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        generate_main(["--checkpoint", target, "--prompt", "w1 w2", "--max-new-tokens", "2",
                       *[tok if f == "TOKENIZER" else f for f in flags]])
    assert needle in str(e.value), str(e.value)


def test_generate_cli_on_a_checkpoint_without_config_exits_2_with_one_line(made, tmp_path):
    import subprocess
    import sys

    root = tmp_path / "checkpoints"
    shutil.copytree(made, root)
    (root / "step_00000004" / "config.toml").unlink()
    r = subprocess.run([sys.executable, "-m", "shardfit", "generate", "--checkpoint", str(root / "step_00000004"),
                        "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("shardfit: error:"), r.stderr
    assert "missing config.toml" in lines[0] and "step_00000004" in lines[0]
