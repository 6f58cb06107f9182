"""Two tiny Triton kernels for the compile check's control (tests/core/test_kernel_compile.py):
the same store, reading its constant from a plain Python global (which only the
interpreter accepts) and from a ``tl.constexpr`` one (which the GPU compiler accepts)."""

import triton
import triton.language as tl

_THREE = 3.0
_THREE_CONST = tl.constexpr(3.0)


@triton.jit
def plain_global_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32) + _THREE)


@triton.jit
def constexpr_global_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32) + _THREE_CONST)
