"""Where shardfit.weights sits among the packages, read from the source as tests/test_import_graph.py reads it (lazy
imports included): above the modules it fills (adapters/) and the layout it reads into (parallel/), below everything
that calls it. So the module transforms do no file I/O and the config loader reads no weight file itself."""

from __future__ import annotations

from tests.test_import_graph import _edges, _modules

# every package weights/ may import; the packages below it, which must not import it
BELOW = ("errors", "fsutil", "safe_pickle", "kernels", "config", "models", "data", "adapters", "parallel")


def _package_edges() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, bs in _edges(_modules()).items():
        pa = a.split(".")[1] if "." in a else a
        out.setdefault(pa, set()).update(b.split(".")[1] if "." in b else b for b in bs)
    return {p: targets - {p} for p, targets in out.items()}


def test_weights_sits_above_adapters_and_parallel_and_below_its_callers():
    edges = _package_edges()
    assert "hf" not in edges  # one room for weights: Hugging Face files are weights/'s
    assert edges["weights"] <= set(BELOW) and {"adapters", "parallel"} <= edges["weights"]
    assert [p for p in BELOW if "weights" in edges.get(p, set())] == []
    assert edges["adapters"] & {"parallel", "weights"} == set()  # module transforms: no sharding, no files
    assert edges["config"] & {"adapters", "weights"} == set()  # lora.adapter is read by the caller's reader
    assert {"train", "cli", "sampling"} <= {p for p, targets in edges.items() if "weights" in targets}
