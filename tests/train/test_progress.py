"""Trackers get what metrics.jsonl gets: TensorBoard read back from its event files, W&B from an offline run."""

import json
import time

import pytest

from shardfit.train.progress import Progress, scalars

STEP = {"step": 10, "total_steps": 20, "device": "cpu", "loss": 2.5, "grad_norm": 0.75, "lr": 1e-3,
        "tokens_per_s_per_gpu": 1234.5, "mfu": None, "eta_s": 3.0, "peak_allocated_max": 0.5}
EVAL = {"step": 10, "val_loss": 2.75, "val_tokens": 4096, "val_s": 0.25}


def _jsonl_numbers(run_dir) -> dict[tuple[int, str], float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.update({(rec["step"], k): v for k, v in scalars(rec).items()})
    return out


def _tensorboard_numbers(run_dir) -> dict[tuple[int, str], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {(e.step, tag): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def test_tensorboard_receives_every_number_of_both_records(tmp_path):
    pytest.importorskip("tensorboard")
    p = Progress(tmp_path, 20, 0, "none", enabled=True, tensorboard=True, logging={})
    p.log(STEP)
    p.log_eval(EVAL)
    p.close()
    got = _tensorboard_numbers(tmp_path)
    want = _jsonl_numbers(tmp_path)
    assert set(got) == set(want) and (10, "val_loss") in got and (10, "mfu") not in got  # None: no number
    assert all(got[k] == pytest.approx(v, rel=1e-6) for k, v in want.items())  # float32 in the event file


def test_training_run_writes_tensorboard_as_metrics_jsonl(tmp_path):
    """The real thing: the trainer's records (rank 0), read back from TensorBoard's event files."""
    pytest.importorskip("tensorboard")
    from shardfit.parallel import shutdown_distributed
    from shardfit.train import Trainer
    from tests.helpers import small_config

    run = tmp_path / "run"
    cfg = small_config("--train.device=cpu", "--logging.tensorboard=true", "--logging.log_every=1",
                       "--data.val_fraction=0.1", "--train.eval_every=2", run_dir=str(run))
    try:
        Trainer(cfg).fit()
    finally:
        shutdown_distributed()
    got, want = _tensorboard_numbers(run), _jsonl_numbers(run)
    assert {s for s, k in want if k == "loss"} == {1, 2, 3, 4} and (4, "val_loss") in want
    assert set(got) == set(want)
    assert all(got[k] == pytest.approx(v, rel=1e-6) for k, v in want.items())


def _wandb_offline_records(run_dir) -> tuple[dict[tuple[int, str], float], dict]:
    """The history rows and the config of the one offline run under run_dir, read from its .wandb file: a LevelDB-style
    log (7-byte file header; 32 KiB blocks of records with a 7-byte header: crc, length, kind 1 full / 2 first /
    3 middle / 4 last) of protobuf Records."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = next((run_dir / "wandb").glob("offline-run-*/*.wandb")).read_bytes()
    pos, block, records, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # block trailer or padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(buf)
            buf = b""
    history, config = {}, {}
    for raw in records:
        r = wandb_internal_pb2.Record()
        r.ParseFromString(raw)
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.update({(r.history.step.num, k): v for k, v in row.items() if not k.startswith("_")})
        elif r.WhichOneof("record_type") == "run":
            config = {i.key: json.loads(i.value_json) for i in r.run.config.update}
    return history, config


def test_wandb_offline_run_gets_the_records_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "config.toml").write_text('[logging]\nwandb = true\nwandb_mode = "offline"\nwandb_project = "t"\n'
                                          '[train]\nlr = 0.001\n')
    p = Progress(tmp_path, 20, 0, "none", enabled=True)  # settings from the run's resolved config, as in a run
    p.log(STEP)
    p.log_eval(EVAL)
    p.log({**STEP, "step": 20, "loss": 1.5})
    p.close()
    # wandb.finish() in offline mode can return before wandb's service has written the records (seen in 2 of 25
    # runs with wandb 0.31: a 7-byte file, complete a moment later): wait for them, up to 30 s
    deadline = time.monotonic() + 30
    while not (records := _wandb_offline_records(tmp_path))[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    history, config = records
    want = _jsonl_numbers(tmp_path)
    assert history == pytest.approx(want) and (10, "val_loss") in history and (20, "loss") in history
    train = config["train"].get("value", config["train"])  # {"value": ...} in some wandb releases
    assert train["lr"] == 0.001  # the resolved config, shown beside the run


def test_only_an_enabled_progress_opens_trackers(tmp_path):
    """Ranks other than 0 make a disabled Progress: no metrics file, no tracker, whatever the config says."""
    (tmp_path / "config.toml").write_text('[logging]\nwandb = true\nwandb_mode = "offline"\n')
    p = Progress(tmp_path, 20, 0, "none", enabled=False, tensorboard=True)
    p.log(STEP)
    p.close()
    assert p.tb is None and p.wandb is None and sorted(tmp_path.iterdir()) == [tmp_path / "config.toml"]


@pytest.mark.parametrize("device, world, has, hasnt", [
    ("cpu", 1, ["1,234 tok/s |", "host rss 0.50 GiB |", "fwd/bwd/opt 0.100/0.200/0.010 s"], ["gpu", "comm", "max"]),
    ("cpu", 2, ["1,234 tok/s/process", "host rss 0.50 GiB (max process)", "fwd/bwd/opt/comm"], ["gpu"]),
    ("cuda", 2, ["1,234 tok/s/gpu", "mem 0.50/0.75 GiB (alloc/resv, max rank)", "fwd/bwd/opt/comm"], ["rss"]),
])
def test_the_log_line_says_what_applies(device, world, has, hasnt):
    """Issue 27: a CPU run said tok/s/gpu, showed a communication time for one process and called RSS allocated."""
    from shardfit.train.progress import format_line

    rec = {"step": 3, "total_steps": 10, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s_per_gpu": 1234.4,
           "device": device, "world": world, "peak_allocated_max": 0.5, "peak_reserved_max": 0.75, "eta_s": 5,
           "time_forward_s": 0.1, "time_backward_s": 0.2, "time_optimizer_s": 0.01, "time_comm_wait_s": 0.001}
    line = format_line(rec)
    assert all(x in line for x in has) and not any(x in line for x in hasnt), line
