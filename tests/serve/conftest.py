import contextlib
import os
import threading

import pytest

os.environ["TINKER_TELEMETRY"] = "0"  # the SDK's telemetry goes to this server's /telemetry only when on


def start_fake(cfg):
    """The server's HTTP side and command loop in this process, on a one-process fake Engine made from `cfg`; end it
    with stop_fake (a restart: stop_fake, then start_fake on the same run directory)."""
    from shardfit.serve.server import start_rank0
    from tests.serve.fake_engine import RL_TYPES, FakeEngine

    engine = FakeEngine(cfg)
    serving = start_rank0(cfg, engine, port=0, rl_types=RL_TYPES, poll_s=2.0, max_body=1 << 20)
    serving.loop_thread = threading.Thread(target=serving.loop.run, daemon=True)
    serving.loop_thread.start()
    serving.engine = engine
    return serving


def stop_fake(serving) -> None:
    serving.state.scheduler.close()
    serving.loop_thread.join(10)
    serving.stop()


@pytest.fixture
def served(tmp_path):
    """The server on the fake Engine (start_fake), tiny model, run directory under tmp_path."""
    from tests.serve.fake_engine import tiny_config

    serving = start_fake(tiny_config(tmp_path))
    yield serving
    stop_fake(serving)


@pytest.fixture
def sdk_client():
    """make(url, api_key) -> tinker.ServiceClient, each one's session finished when the test ends (pass or fail): a
    client left open keeps its heartbeat thread, which outlives the test's server and prints "Session heartbeat
    failed" at the end of the run. Ask for it after the server fixture, so that it ends first."""
    import tinker

    made = []

    def make(url: str, api_key: str):
        made.append(tinker.ServiceClient(base_url=url, api_key=api_key))
        return made[-1]

    yield make
    for sc in made:
        with contextlib.suppress(Exception):  # a failed test's server may be gone: close() released the client anyway
            sc.close("success").result(timeout=30)
