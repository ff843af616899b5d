"""serve/executor.py: frozen versions pile up silently where a loop makes a snapshot sampler every step and never
closes its session (an SDK client dropped sends nothing; the cookbook's RL loop does this): the log tells it when the
versions held reach 16, then 32, ... with the bytes on the device and in host memory (the registry's own counts) and
the fix, once each; freeing them is still the session's close or the save's ttl_seconds."""

from __future__ import annotations

from tests.helpers import SMALL

# versions_gib small enough that most versions go to the host: the line must say where they are
ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=32", "--logging.run_dir=", "--lora.rank=4",
        "--memory.versions_gib=0.0001"]


def test_the_log_tells_when_versions_held_reach_16_then_32():
    from shardfit.config import load_config
    from shardfit.engine import Engine
    from shardfit.serve.commands import Command
    from shardfit.serve.executor import VERSIONS_NOTED, Executor

    ex = Executor(Engine.start(load_config(None, ARGS)))  # as serve/server.py makes it
    told = {}
    for i in range(1, 2 * VERSIONS_NOTED + 2):
        ex(Command("sampler_snapshot", f"req-{i}", {"sampling_session_id": f"s{i}", "freeze": True}, "default"))
        lines = ex.take_notes()
        if lines:
            told[i] = lines
    assert sorted(told) == [VERSIONS_NOTED, 2 * VERSIONS_NOTED]  # once at 16, once at 32, nothing between
    s = ex.held()
    assert s["versions"] == 2 * VERSIONS_NOTED + 1 and s["version_host_bytes"] > 0
    (line,) = told[2 * VERSIONS_NOTED]
    gib = 1 << 30
    assert line.startswith(f"{2 * VERSIONS_NOTED} frozen weight versions held")
    per = s["version_host_bytes"] / (s["versions"] - s["versions_on_device"])  # one version's bytes
    host_then = s["version_host_bytes"] - per  # the 33rd went to the host after the line
    assert f"{host_then / gib:.2f} GiB in host memory" in line
    assert "close()" in line and "ttl_seconds" in line and "kind='inflight'" in line
    assert ex.take_notes() == []  # each told once
    # releasing them leaves nothing to tell and frees them
    ex(Command("release_samplers", "req-r", {"sampling_session_ids": [f"s{i}" for i in range(1, 34)]}, "default"))
    assert ex.held()["versions"] == 0 and ex.take_notes() == []
