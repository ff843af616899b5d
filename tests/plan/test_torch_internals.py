"""The planner's private PyTorch APIs live in one guarded module: importing the planner needs none of them, and a
torch without one is one `shardfit: error:` line naming the torch version, the internal and what needed it."""

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

from shardfit.cli.main import main
from shardfit.errors import ShardfitError
from shardfit.plan import activation_trace, torch_internals

PLAN = Path(__file__).resolve().parents[2] / "src" / "shardfit" / "plan"
ARGS = ["plan", "--nproc", "1", "--gpu-memory", "80", "--data.seq_len=64"]


@pytest.fixture
def clear_traces():
    """Empties the trace caches (a cached count would not look the internals up again); again after the test."""
    def clear():
        for cached in (activation_trace._saved_ops_mode, activation_trace._block_bytes, activation_trace.compiled_line):
            cached.cache_clear()

    yield clear
    clear()


@pytest.mark.parametrize("module,name,flags", [
    ("torch.utils._python_dispatch", "TorchDispatchMode", []),
    ("torch._functorch.aot_autograd", "aot_function", ["--compute.compile=true"]),
])
def test_a_torch_without_an_internal_plans_nothing_and_says_what_is_missing(module, name, flags, monkeypatch,
                                                                             capsys, clear_traces):
    """The plan runs once as it is (torch's own modules load what they need), then with the internal gone, as on a
    torch that moved it: `shardfit plan` is one line naming the torch version, the internal and the fix, exit 2."""
    assert main([*ARGS, *flags]) == 0
    capsys.readouterr()
    clear_traces()
    monkeypatch.delattr(importlib.import_module(module), name)
    assert main([*ARGS, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"shardfit: error: torch {torch.__version__}: {module}.{name} is "
                                               "missing, which the memory planner"), err
    assert "train.micro_batch=0" in err[0] and "fix:" in err[0]


def test_importing_the_planner_needs_no_private_torch_api():
    """torch_internals imports only public modules at its top; every private lookup runs inside a function."""
    tree = ast.parse((PLAN / "torch_internals.py").read_text(encoding="utf-8"))
    top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert top == {"__future__", "functools", "importlib", "torch", "shardfit.errors"}
    inside = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} - top
    assert inside == set() and "import_module(module)" in ast.unparse(tree)  # lookups by name, at call time


def test_each_lookup_fails_as_one_shardfit_error(monkeypatch):
    """Every getter answers with the internal while it exists, and with the one line once it is gone."""
    assert issubclass(torch_internals.dispatch_mode_base(), object)
    assert callable(torch_internals.aot_function()) and callable(torch_internals.inductor_partition())
    t = torch.empty(4, device="meta")
    assert torch_internals.storage_id(t[1:]) == torch_internals.storage_id(t)  # views share their storage
    assert torch_internals.storage_id(torch.empty(4, device="meta")) != torch_internals.storage_id(t)
    import torch._functorch.aot_autograd as aot

    monkeypatch.delattr(aot, "aot_function")
    with pytest.raises(ShardfitError, match=re.escape(f"torch {torch.__version__}: torch._functorch.aot_autograd."
                                                      "aot_function is missing")):
        torch_internals.aot_function()

    class NoIdentity:  # a storage without _cdata (torch's C type cannot lose the attribute itself)
        def untyped_storage(self):
            return object()

    with pytest.raises(ShardfitError, match=r"torch.UntypedStorage._cdata is missing.*each saved storage once"):
        torch_internals.storage_id(NoIdentity())


def test_no_other_planner_module_touches_a_private_torch_api():
    """The guarded module is the only way in: the rest of the planner names no torch._*, torch.utils._* or _cdata."""
    private = re.compile(r"torch\.(_[a-z]|utils\._|ops\.aten\._)|functorch|_cdata")
    offenders = {f.name: m.group(0) for f in PLAN.glob("*.py") if f.name != "torch_internals.py"
                 for m in [private.search(f.read_text(encoding="utf-8"))] if m}
    assert offenders == {}
    assert private.search((PLAN / "torch_internals.py").read_text(encoding="utf-8"))  # the pattern does match
