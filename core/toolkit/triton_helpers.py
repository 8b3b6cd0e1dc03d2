"""``@triton.jit`` helpers for backend kernels, and the interpreter loop-bound fix.

Importing this module imports triton.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from pagedkv.toolkit.numerics import LOG2E

__all__ = ["LOG2E", "fix_interpreter_loop_bounds", "fp32_to_fp8_bits"]


@triton.jit
def _rtne_shift_right(v, r):
    """v / 2**r rounded to nearest, ties to even, for v >= 0 and 1 <= r <= 31."""
    q = v >> r
    rem = v - (q << r)
    half = 1 << (r - 1)
    round_up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + round_up.to(tl.int32)


@triton.jit
def fp32_to_fp8_bits(x, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr):
    """The fp8 bit pattern (int32 in [0, 255]) of finite fp32 ``x`` inside the format's range.

    Integer rounding instead of a float conversion: Triton's interpreter converts
    fp32 -> fp8 without ties-to-even and without subnormals, and the cache must be
    bit-identical on the CPU and the GPU.
    """
    BIAS: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    exponent = mag >> 23  # biased fp32 exponent
    # normal result: drop the low mantissa bits (a carry may bump the exponent), re-bias
    normal = _rtne_shift_right(mag, 23 - MAN_BITS) - ((127 - BIAS) << MAN_BITS)
    # subnormal result: the significand in units of the smallest subnormal
    significand = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum((151 - BIAS - MAN_BITS) - exponent, 1), 31)
    subnormal = _rtne_shift_right(significand, shift)
    code = tl.where(exponent < 128 - BIAS, subnormal, normal)
    code = tl.where(exponent == 0, 0, code)  # fp32 zeros and subnormals
    return (sign << 7) | code


def fix_interpreter_loop_bounds() -> None:
    """Let Triton's interpreter take runtime loop bounds under NumPy >= 2.4.

    The interpreter holds scalars as shape-(1,) arrays and converts loop bounds
    with ``int(array)``, which NumPy 2.4 rejects (triton-lang/triton#9171, fixed
    after triton 3.6). This re-applies the upstream fix (squeeze first) each time
    the interpreter patches ``tl.tensor``; it only touches the interpreter.
    Kernel modules with runtime-bounded loops call it when they are imported.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "fixes_loop_bounds", False):
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.fixes_loop_bounds = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor
