"""What the Triton kernels of this package share: the reductions' combine functions and the interpreter switch.

The kernels spell their reductions with tl.reduce and the combine functions made here, not with triton's library
reductions (tl.max, tl.sum): those are jit-wrapped when triton is imported, and under Triton's interpreter
(TRITON_INTERPRET=1, set by the tests after triton may have been imported) they cannot be called. Functions made
after the switch can: `combine_fns(interpret)` makes them once per mode, and each kernel's factory puts them among
its module's globals, where triton (compiled and interpreted) resolves a kernel's callees.
"""

from __future__ import annotations

import functools
import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def combine_fns(interpret: bool) -> dict | None:
    """{"maximum", "add", "first_best"} as triton.jit functions (None without Triton); `interpret`: a cache entry
    per mode (triton.jit reads TRITON_INTERPRET when it wraps)."""
    del interpret
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def maximum(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def add(a, b):
        return a + b

    @triton.jit
    def first_best(a, ia, b, ib):  # argmax's combine: the larger value, a tie to the smaller index
        left = (a > b) | ((a == b) & (ia < ib))
        return tl.where(left, a, b), tl.where(left, ia, ib)

    return {"maximum": maximum, "add": add, "first_best": first_best}
