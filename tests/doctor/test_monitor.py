from shardfit.doctor import MemoryMonitor


def _mem(reserved, retries=0.0):
    return {"reserved_max": reserved, "alloc_retries_max": retries}


def test_warns_on_growth_after_warmup_and_on_retries():
    m = MemoryMonitor(growth_warn_gib=0.5, warmup_logs=1)
    assert m.update(_mem(10.0)) == []
    assert m.update(_mem(12.0)) == []  # still warming up: optimizer state appears after the first step
    assert m.update(_mem(12.2)) == []  # below the threshold
    w = m.update(_mem(13.0))
    assert len(w) == 1 and "grew 819 MiB" in w[0]
    w = m.update(_mem(13.0, retries=3))
    assert len(w) == 1 and "3 allocator retries" in w[0]
    assert m.update(_mem(13.0, retries=3)) == []  # only new retries warn
