"""Who may read what, and for how long, against a running server (raw HTTP): request ids are unguessable and read
only with the key that made them (another key's retrieve, status or idempotent retry learns nothing), results nobody
reads expire (410, the SDK's 'expired'), a run directory is held by one server, and the key file is never written
through a planted link."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.serve.raw_http import Client, fb_body

ROOT = Path(__file__).resolve().parents[2]


def test_a_future_is_read_by_the_key_that_made_it_alone(served):
    alice = Client(served.url, "tml-alice")
    mallory = Client(served.url, "tml-mallory", model=False)  # the fake Engine trains every parameter: one model
    headers = {**alice.proto, "X-Idempotency-Key": "retry-1"}
    rid = alice.http.post("/forward_backward", content=fb_body(alice.model_id, alice.next_seq()),
                          headers=headers).json()["request_id"]
    assert re.fullmatch(r"req-[A-Za-z0-9_-]{22,}", rid)  # 128 random bits, not a counter
    # another key: the id is as unknown as one never issued, the status lists none of alice's ids, and replaying
    # alice's idempotency key makes mallory's own request instead of returning alice's answer
    r = mallory.http.post("/retrieve_future", json={"request_id": rid}, headers=mallory.key)
    assert r.status_code == 404 and "never issued to this key" in r.json()["detail"]
    assert rid not in mallory.http.get("/shardfit/status", headers=mallory.key).text
    replay = mallory.http.post("/forward_backward", content=fb_body(alice.model_id, alice.next_seq()),
                               headers={**mallory.proto, "X-Idempotency-Key": "retry-1"}).json()["request_id"]
    assert replay != rid
    assert alice.result(rid).metrics["loss:sum"] > 0  # and alice reads hers
    assert rid in alice.http.get("/shardfit/status", headers=alice.key).json()["requests"]


def test_results_nobody_reads_expire_and_the_store_is_capped(served):
    c = Client(served.url)
    served.state.futures.unread_s = 0.3
    rid = c.http.post("/forward_backward", content=fb_body(c.model_id, c.next_seq()),
                      headers=c.proto).json()["request_id"]
    for _ in range(100):  # finished, never read
        if served.state.futures.state(rid, served.state.futures.timing(rid).owner) == "done":
            break
        time.sleep(0.05)
    time.sleep(0.5)
    r = c.http.post("/retrieve_future", json={"request_id": rid}, headers=c.key)
    assert r.status_code == 410 and "expired" in r.json()["detail"]
    served.state.futures.unread_s, served.state.futures.max_kept = 3600, 3
    rids = [c.http.post("/forward_backward", content=fb_body(c.model_id, c.next_seq()),
                        headers=c.proto).json()["request_id"] for _ in range(6)]
    last = c.result(rids[-1])  # in seq order: every earlier one has finished
    assert last.metrics["loss:sum"] > 0
    codes = [c.http.post("/retrieve_future", json={"request_id": r}, headers=c.key).status_code for r in rids[:-1]]
    assert codes.count(410) >= 2 and codes[-1] == 200, codes  # the oldest went first
    assert len(served.state.futures._results) <= 3


def test_a_run_directory_is_held_by_one_server(served, tmp_path):
    from shardfit.errors import ShardfitError
    from shardfit.serve.server import start_rank0
    from tests.serve.fake_engine import RL_TYPES, FakeEngine

    cfg = served.engine.cfg
    with pytest.raises(ShardfitError, match=r"run directory is locked: another run is using it \(.*\"pid\": "
                                            rf"{os.getpid()}.*fix: stop the server"):
        start_rank0(cfg, FakeEngine(cfg), port=0, rl_types=RL_TYPES, api_key="tml-other")
    # as a user meets it: `shardfit serve` on the same directory stops at once, in one line, before any model
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "shardfit", "serve", "--port=0",
                        f"--logging.run_dir={served.state.run_dir}", "--train.device=cpu"], capture_output=True,
                       text=True, timeout=120, env=env)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "run directory is locked" in lines[0], lines
    assert not (served.state.run_dir / "api_key").exists()  # the second server wrote nothing there


def test_the_key_file_is_never_written_through_a_link(tmp_path, monkeypatch):
    from shardfit.errors import ShardfitError
    from shardfit.serve import security

    run, victim = tmp_path / "run", tmp_path / "victim"
    run.mkdir()
    victim.write_text("precious")
    (run / "api_key.tmp").symlink_to(victim)  # the old, fixed temporary name
    (run / "api_key").symlink_to(victim)
    key = security.setup_api_key("0.0.0.0", run, None)
    assert victim.read_text() == "precious"
    f = run / "api_key"
    assert not f.is_symlink() and f.read_text().strip() == key and stat.S_IMODE(f.stat().st_mode) == 0o600
    monkeypatch.setattr(security.secrets, "token_hex", lambda n: "fixed")  # a link planted at the very name
    (run / ".api_key.fixed.tmp").symlink_to(victim)
    with pytest.raises(ShardfitError, match="already"):
        security.setup_api_key("0.0.0.0", run, None)
    assert victim.read_text() == "precious" and f.read_text().strip() == key
