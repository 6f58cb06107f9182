"""A control for Triton's interpreter: does it compute a bf16 dot product right?

Triton 3.9's interpreter (``TRITON_INTERPRET=1``, numpy underneath, which has no bfloat16)
returns garbage for ``tl.dot`` on bf16 inputs, so the kernels' bf16 results on the CPU say
nothing about the kernels. The doctor runs this once before its bf16 kernel checks in the
interpreter and skips them, saying why, where the control fails. Imported only where the
kernels run (it imports triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _square_kernel(x_ptr, out_ptr, B: tl.constexpr):
    i = tl.arange(0, B)
    x = tl.load(x_ptr + i[:, None] * B + i[None, :])
    tl.store(out_ptr + i[:, None] * B + i[None, :], tl.dot(x, x))


def bf16_dot_works(device: torch.device) -> bool:
    """Whether a 16 x 16 bf16 ``tl.dot`` on ``device`` matches torch's float32 product (small
    integers: every product and sum is exact in float32, so any difference is an error)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (16, 16), generator=g).to(torch.bfloat16).to(device)
    out = torch.empty(16, 16, dtype=torch.float32, device=device)
    _square_kernel[(1,)](x, out, B=16)
    return torch.equal(out, x.float() @ x.float())
