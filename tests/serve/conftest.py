import os
import threading

import pytest

os.environ["TINKER_TELEMETRY"] = "0"  # the SDK's telemetry goes to this server's /telemetry only when on


@pytest.fixture
def served(tmp_path):
    """The server's HTTP side and command loop in this process, on the one-process fake Engine."""
    from shardfit.serve.server import start_rank0
    from tests.serve.fake_engine import RL_TYPES, FakeEngine, tiny_config

    cfg = tiny_config(tmp_path)
    engine = FakeEngine(cfg)
    serving = start_rank0(cfg, engine, port=0, rl_types=RL_TYPES, poll_s=2.0, max_body=1 << 20)
    loop = threading.Thread(target=serving.loop.run, daemon=True)
    loop.start()
    serving.engine = engine
    yield serving
    serving.state.scheduler.close()
    loop.join(10)
    serving.stop()
