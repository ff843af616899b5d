"""The checkpoint writer without the optimizer (weights/checkpoint.py, Engine.save_state(optimizer=False): a sampler's
save): on 2 gloo ranks it is smaller by exactly the optimizer state's bytes (and their framing), holds every trained
tensor, checks out whole, loads back to the same weights with load_state(optimizer=False), and restoring an optimizer
from it is one line naming the step directory."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tests._dist import run_ranks
from tests.helpers import SMALL, full_state

ARGS = [*SMALL, "--train.device=cpu", "--logging.run_dir="]


def _data_bytes(step: Path) -> int:
    return sum(f.stat().st_size for f in step.glob("__*.distcp"))


def _tensor_bytes(meta, keys) -> int:
    """The bytes of these tensors as the checkpoint's index declares them (global shapes)."""
    return sum(math.prod(meta.state_dict_metadata[k].size) * meta.state_dict_metadata[k].properties.dtype.itemsize
               for k in keys)


def _items(meta, keys) -> int:
    """The saved items (one torch.save archive each: a rank's chunk of a tensor) of these tensors."""
    return sum(index.fqn in keys for index in meta.storage_data)


def _save_without_optimizer(rank, world, root):
    from shardfit.config import load_config
    from shardfit.engine import Engine
    from shardfit.errors import ShardfitError
    from shardfit.weights.checkpoint import load_checkpoint

    engine = Engine.start(load_config(None, ARGS))
    full = engine.save_state(Path(root) / "full")  # the optimizer's state is created on first save if it has none
    light = engine.save_state(Path(root) / "light", optimizer=False)
    # this rank's shards of Adam's moments (the parameter's local rows, fp32)
    moments = [t.to_local() for s in engine.optimizer.state.values() for k, t in s.items() if k.startswith("exp_avg")]
    saved = {k: v.clone() for k, v in full_state(engine.model).items()}
    with torch.no_grad():  # move every weight away from the saved ones
        for p in engine.model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).add_(1.0)
    step = engine.step
    engine.load_state(light, optimizer=False)
    loaded = full_state(engine.model)
    try:
        engine.load_state(light)  # optimizer=True: refused, the same on every rank
        refused = None
    except ShardfitError as e:
        refused = str(e)
    try:  # the Trainer's resume path takes the same refusal (one loader)
        load_checkpoint(light, engine.model, engine.optimizer, engine.device)
        resumed = None
    except ShardfitError as e:
        resumed = str(e)
    return {"full": str(full), "light": str(light), "moments": sum(t.numel() * t.element_size() for t in moments),
            "same": all(torch.equal(saved[k], loaded[k]) for k in saved), "step": [step, engine.step],
            "refused": refused, "resumed": resumed}


def test_a_save_without_the_optimizer_is_smaller_by_its_state_and_loads_back(tmp_path):
    from shardfit.weights.checkpoint_verify import check_files, read_metadata

    results = run_ranks(_save_without_optimizer, 2, str(tmp_path))
    r = results[0]
    full, light = Path(r["full"]), Path(r["light"])
    assert check_files(full) is None and check_files(light) is None  # checked whole, as every checkpoint
    meta_full, meta_light = read_metadata(full), read_metadata(light)
    keys_full, keys_light = set(meta_full.state_dict_metadata), set(meta_light.state_dict_metadata)
    optim_keys = {k for k in keys_full if k.startswith("optim.")}
    assert optim_keys and keys_light == keys_full - optim_keys  # every model tensor and buffer, no optimizer tensor
    # the index's optimizer tensors are the live optimizer's: both ranks' shards of the two moments (+ step counters)
    moments = {k for k in optim_keys if k.endswith((".exp_avg", ".exp_avg_sq"))}
    assert _tensor_bytes(meta_full, moments) == sum(x["moments"] for x in results) > 0
    # smaller by the optimizer's bytes, and each of its items' torch.save framing as much as a model item's (the
    # light save's bytes beyond its tensors, per item; up to 63 bytes of alignment each)
    framing = (_data_bytes(light) - _tensor_bytes(meta_light, keys_light)) / _items(meta_light, keys_light)
    n = _items(meta_full, optim_keys)
    expected = _tensor_bytes(meta_full, optim_keys) + framing * n
    assert abs(_data_bytes(full) - _data_bytes(light) - expected) <= 64 * n
    assert _data_bytes(light) < _data_bytes(full) / 2  # Adam: two fp32 moments a weight
    assert all(x["same"] for x in results)  # the weights as saved
    assert r["step"][0] == r["step"][1]  # weights only: the step stays the Engine's
    for x in results:  # one line, naming the step directory and the fix, on every rank alike
        for message in (x["refused"], x["resumed"]):
            assert message is not None and "\n" not in message
            assert message.startswith(f"{light}: saved without the optimizer's state")
            assert "optimizer=False" in message
