"""The Tinker REST listings through the official SDK's RestClient (serve/listings.py), on the one-process fake Engine:
each call returns what was created or saved, checkpoints after a restart too, and a path that does not exist is one
4xx line naming it."""

import httpx
import pytest

tinker = pytest.importorskip("tinker")

from tests.serve.conftest import start_fake, stop_fake  # noqa: E402
from tests.serve.fake_engine import tiny_config  # noqa: E402

KEY = "tml-test"


def _rest(url: str):
    return tinker.RestClient(base_url=url, api_key=KEY)


def _refusal(call) -> str:
    with pytest.raises(tinker.BadRequestError) as e:
        call().result(timeout=60)
    assert e.value.status_code == 400
    return str(e.value)


def _saved(sc) -> tuple[object, str, str]:
    """A training client, its save_state path and its named sampler save's path (saved in this order)."""
    tc = sc.create_lora_training_client(base_model="tiny", rank=0).result()
    return tc, tc.save_state("w1").result().path, tc.save_weights_for_sampler("s1").result().path


def test_capabilities_name_the_served_model(served):
    caps = _rest(served.url).get_server_capabilities().result(timeout=60)
    assert [(m.model_name, m.max_context_length, m.trainable, m.sampleable) for m in caps.supported_models] == [
        ("tiny", served.state.facts.max_seq_len, True, True)]


def test_runs_and_checkpoints_list_what_was_made(served, sdk_client):
    sc, rest = sdk_client(served.url, KEY), _rest(served.url)
    tc, w, s = _saved(sc)
    run = tc.model_id
    runs = rest.list_training_runs().result(timeout=60)
    assert [r.training_run_id for r in runs.training_runs] == [run]
    assert (runs.cursor.offset, runs.cursor.limit, runs.cursor.total_count) == (0, 20, 1)
    r = runs.training_runs[0]
    assert (r.base_model, r.is_lora, r.lora_rank) == ("tiny", False, None)  # the fake Engine trains every parameter
    assert (r.last_checkpoint.tinker_path, r.last_sampler_checkpoint.tinker_path) == (w, s)
    assert rest.get_training_run(run).result(timeout=60).last_checkpoint.tinker_path == w

    mine = rest.list_user_checkpoints().result(timeout=60)
    assert [(c.tinker_path, c.checkpoint_type, c.checkpoint_id) for c in mine.checkpoints] == [
        (s, "sampler", "sampler_weights/s1"), (w, "training", "weights/w1")]  # newest first
    assert all(c.size_bytes > 0 for c in mine.checkpoints) and mine.cursor.total_count == 2
    second = rest.list_user_checkpoints(limit=1, offset=1).result(timeout=60)
    assert [c.tinker_path for c in second.checkpoints] == [w]
    assert (second.cursor.offset, second.cursor.limit, second.cursor.total_count) == (1, 1, 2)
    assert {c.tinker_path for c in rest.list_checkpoints(run).result(timeout=60).checkpoints} == {w, s}

    info = rest.get_weights_info_by_tinker_path(w).result(timeout=60)
    assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", False, None)

    resumed = sc.create_training_client_from_state(w).result()  # a second training run, newest first
    assert [r.training_run_id for r in rest.list_training_runs().result(timeout=60).training_runs] == [
        resumed.model_id, run]
    assert rest.list_training_runs(project_id="elsewhere").result(timeout=60).training_runs == []


def test_a_missing_path_or_a_bad_page_is_one_line_naming_it(served, sdk_client):
    sc, rest = sdk_client(served.url, KEY), _rest(served.url)
    tc, _, _ = _saved(sc)
    missing = f"tinker://{tc.model_id}/weights/nope"
    said = _refusal(lambda: rest.get_weights_info_by_tinker_path(missing))
    assert f"no checkpoint at '{missing}'" in said and "/weights_info tinker_path" in said
    said = _refusal(lambda: rest.get_weights_info_by_tinker_path("tinker://run/elsewhere/x"))
    assert "is not tinker://RUN/weights|sampler_weights/NAME" in said
    said = _refusal(lambda: rest.list_user_checkpoints(limit=0))
    assert "limit='0' is not an integer 1..1000" in said and "/checkpoints ?limit" in said
    assert "unknown model_id 'nope'" in _refusal(lambda: rest.get_training_run("nope"))
    answer = httpx.post(f"{served.url}/api/v1/weights_info", json={}, headers={"X-API-Key": KEY})  # no tinker_path
    assert answer.status_code == 400 and answer.json()["detail"].startswith("tinker_path: Field required")


def test_checkpoints_and_their_runs_are_listed_after_a_restart(tmp_path):
    cfg = tiny_config(tmp_path)
    first = start_fake(cfg)
    try:
        sc = tinker.ServiceClient(base_url=first.url, api_key=KEY)
        try:
            tc, w, s = _saved(sc)
            run = tc.model_id
        finally:
            sc.close("success").result(timeout=30)
    finally:
        stop_fake(first)
    again = start_fake(cfg)
    try:
        rest = _rest(again.url)
        assert [c.tinker_path for c in rest.list_user_checkpoints().result(timeout=60).checkpoints] == [s, w]
        runs = rest.list_training_runs().result(timeout=60).training_runs
        assert [(r.training_run_id, r.base_model, r.last_checkpoint.tinker_path) for r in runs] == [(run, "tiny", w)]
        assert rest.get_training_run(run).result(timeout=60).last_sampler_checkpoint.tinker_path == s
        assert rest.get_weights_info_by_tinker_path(s).result(timeout=60).base_model == "tiny"
    finally:
        stop_fake(again)


def test_a_checkpoint_reports_the_lora_it_was_saved_with(tmp_path):
    """get_weights_info and a run known from disk read the META as saved, not the facts of the server now running."""
    import json

    from shardfit.serve.listings import lora_facts
    from shardfit.serve.state import ModelFacts, ServerState

    lora = ServerState(ModelFacts("tiny", 256, 128, lora_rank=8, lora_targets="q_proj,v_proj"), tmp_path, None)
    meta = json.loads(lora.checkpoint_meta("tinker://r/weights/a", "weights", "r"))
    full = ServerState(ModelFacts("tiny", 256, 128), tmp_path, None)  # restarted without --lora.rank
    assert lora_facts(full, meta) == {"is_lora": True, "lora_rank": 8, "train_attn": True, "train_mlp": False,
                                      "train_unembed": False}
    assert lora_facts(full, None)["is_lora"] is False and meta["base_model"] == "tiny"


def test_what_serve_did_not_write_is_not_listed(served, sdk_client):
    """A META that is not JSON or lacks a field, and a link out of the run directory, are skipped, never answered."""
    sc, rest = sdk_client(served.url, KEY), _rest(served.url)
    tc, w, s = _saved(sc)
    kind_dir = served.state.run_dir / "checkpoints" / tc.model_id / "weights"
    (kind_dir / "torn").mkdir()
    (kind_dir / "torn" / ".tinker.json").write_text("{")
    (kind_dir / "bare").mkdir()
    (kind_dir / "bare" / ".tinker.json").write_text('{"tinker_path": "tinker://x/weights/bare"}')
    outside = served.state.run_dir.parent / "outside"
    outside.mkdir()
    (outside / ".tinker.json").write_text((kind_dir / "w1" / ".tinker.json").read_text())
    (kind_dir / "linked").symlink_to(outside)
    assert [c.tinker_path for c in rest.list_user_checkpoints().result(timeout=60).checkpoints] == [s, w]


def test_a_named_save_with_ttl_seconds_expires(served):
    """Tinker's ttl_seconds on save_state and a named save_weights_for_sampler: the checkpoint expires then (the
    listing says when), and is gone from every listing and load after it; a save without one stays."""
    import time

    from tests.serve.raw_http import Client

    c = Client(served.url)

    def save(route: str, name: str, ttl: float | None) -> str:
        r = c.http.post(route, headers=c.key, json={"model_id": c.model_id, "seq_id": c.next_seq(), "path": name,
                                                    "ttl_seconds": ttl})
        assert r.status_code == 200, r.text
        return c.result(r.json()["request_id"])["path"]

    t0 = time.monotonic()
    brief = [save("/save_weights", "w-brief", 1.5), save("/save_weights_for_sampler", "s-brief", 1.5)]
    kept = save("/save_weights", "w-kept", None)
    listed = {ck["tinker_path"]: ck for ck in c.http.get("/checkpoints", headers=c.key).json()["checkpoints"]}
    assert set(listed) == {*brief, kept} and listed[kept]["expires_at"] is None
    assert all(listed[p]["expires_at"] for p in brief)
    time.sleep(max(0.0, 1.6 - (time.monotonic() - t0)))
    listed = [ck["tinker_path"] for ck in c.http.get("/checkpoints", headers=c.key).json()["checkpoints"]]
    assert listed == [kept]
    run_dir = served.state.run_dir / "checkpoints" / c.model_id
    assert not (run_dir / "weights" / "w-brief").exists() and not (run_dir / "sampler_weights" / "s-brief").exists()
    r = c.http.post("/create_sampling_session", headers=c.key, json={"session_id": c.session, "model_path": brief[1]})
    assert r.status_code == 400 and f"no checkpoint at '{brief[1]}'" in r.json()["detail"]
    too_long = c.http.post("/save_weights", headers=c.key, json={"model_id": c.model_id, "seq_id": c.next_seq(),
                                                                 "path": "w-forever", "ttl_seconds": 1e300})
    assert too_long.status_code == 400 and "ttl_seconds=1e+300 is beyond 10 years" in too_long.json()["detail"]


def test_a_meta_whose_expires_at_has_no_time_zone_is_not_ours(tmp_path):
    """read_meta compares expires_at with an aware now: a naive one (not written by serve) is skipped as any META
    serve did not write, never an exception in a listing."""
    import json

    from shardfit.serve.state import META, read_meta

    (tmp_path / META).write_text(json.dumps({"tinker_path": "tinker://r/weights/x", "time": "t",
                                             "checkpoint_type": "training", "expires_at": "2026-01-01T00:00:00"}))
    assert read_meta(tmp_path) is None and (tmp_path / META).is_file()  # not ours: left as it is
