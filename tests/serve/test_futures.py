"""The long poll: a result set from another thread wakes the poll at once; an unfinished one answers None after
the poll time; results read long ago are dropped and then reported as expired, never as unknown."""

import asyncio
import threading
import time

from shardfit.serve.futures import FutureStore, Result


def test_long_poll_wakes_on_completion_and_times_out_otherwise():
    async def main():
        store = FutureStore(poll_s=0.3, keep_s=0.0, max_kept=1)
        store.loop = asyncio.get_running_loop()
        a, b = store.create("sample"), store.create("optim_step")
        t0 = time.monotonic()
        assert await store.wait(a) is None and 0.25 < time.monotonic() - t0 < 2  # held, then try_again
        threading.Timer(0.1, store.complete, (a, Result(json={"ok": 1}), {"sample": 0.05})).start()
        t0 = time.monotonic()
        got = await store.wait(a, timeout=5)
        assert got.body() == {"ok": 1} and time.monotonic() - t0 < 2  # woken, not timed out
        timing = store.timing(a).as_dict()
        assert timing["kind"] == "sample" and timing["sample_s"] == 0.05 and timing["queue_s"] >= 0
        store.complete(b, Result(error="bad", category="user"))
        assert (await store.wait(b)).body() == {"error": "bad", "category": "user"}
        await asyncio.sleep(0.01)
        store.create("x")
        await store.wait(b, timeout=0)  # reading evicts what was read more than keep_s ago
        assert store.state(a) == "expired" and store.state("req-999") == "unknown" and store.state("zz") == "unknown"

    asyncio.run(main())
