"""The futures store: the long poll (a result set from another thread wakes it at once; an unfinished one answers
None after the poll time), unguessable ids bound to the principal that made them, and a bounded store: results read
long ago, or never read, expire (then 'expired', the SDK's 410), and past max_kept the oldest go first."""

import asyncio
import threading
import time

from shardfit.serve.futures import FutureStore, Result


def test_long_poll_wakes_on_completion_and_times_out_otherwise():
    async def main():
        store = FutureStore(poll_s=0.3)
        store.loop = asyncio.get_running_loop()
        a = store.create("sample")
        t0 = time.monotonic()
        assert await store.wait(a) is None and 0.25 < time.monotonic() - t0 < 2  # held, then try_again
        threading.Timer(0.1, store.complete, (a, Result(json={"ok": 1}), {"sample": 0.05})).start()
        t0 = time.monotonic()
        got = await store.wait(a, timeout=5)
        assert got.body() == {"ok": 1} and time.monotonic() - t0 < 2  # woken, not timed out
        timing = store.timing(a).as_dict()
        assert timing["kind"] == "sample" and timing["sample_s"] == 0.05 and timing["queue_s"] >= 0

    asyncio.run(main())


def test_ids_are_unguessable_and_read_by_their_principal_alone():
    store = FutureStore()
    ids = {store.create("x", owner="alice") for _ in range(200)}
    assert len(ids) == 200 and all(len(r) >= 20 and r.startswith("req-") for r in ids)
    rid = next(iter(ids))
    store.complete(rid, Result(json={"secret": 1}))
    assert store.state(rid, "alice") == "done"
    assert store.state(rid, "mallory") == "unknown"  # another key: as if never issued
    assert store.state("req-1", "alice") == store.state("req-²", "alice") == store.state("", "alice") == "unknown"
    snap = store.snapshot("mallory")
    assert snap["requests"] == {} and snap["pending"] == 199  # counts, never another principal's ids


def test_unread_and_old_results_expire_and_the_store_is_capped():
    async def main():
        store = FutureStore(keep_s=0.2, unread_s=0.2, max_kept=2)
        store.loop = asyncio.get_running_loop()
        read, unread = store.create("a", "p"), store.create("b", "p")
        store.complete(read, Result(json={}))
        store.complete(unread, Result(json={}))
        await store.wait(read)
        await asyncio.sleep(0.3)
        assert store.state(read, "p") == store.state(unread, "p") == "expired"  # read long ago; never read
        assert store.state(read, "q") == "unknown"  # expired for its owner only
        many = [store.create("c", "p") for _ in range(4)]
        for r in many:
            store.complete(r, Result(json={}))
        assert [store.state(r, "p") for r in many] == ["expired", "expired", "done", "done"]  # capped, oldest out
        pending = store.create("d", "p")
        for r in [store.create("e", "p") for _ in range(3)]:
            store.complete(r, Result(json={}))
        assert store.state(pending, "p") == "pending"  # never dropped while it runs

    asyncio.run(main())
