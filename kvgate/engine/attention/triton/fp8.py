"""e4m3 rounding done explicitly in fp32, so the final cast to fp8 is exact.

Round-to-nearest-even to the e4m3 grid by bit arithmetic makes the stored bytes identical to
``torch.Tensor.to(torch.float8_e4m3fn)`` on every target, including the Triton interpreter,
whose own fp32 -> fp8 conversion mishandles mantissa carries (127.9 becomes 64, not 128).
Callers clamp to ±448 first.
"""

import triton
import triton.language as tl

# Below 2**-6 e4m3 is subnormal with a fixed spacing of 2**-9: adding 2**14 (whose fp32 ulp
# is 2**-9) and subtracting it again rounds to that grid, ties to even.
_SUBNORMAL_MAGIC = tl.constexpr(16384.0)
_MIN_NORMAL = tl.constexpr(0.015625)


@triton.jit
def round_to_e4m3(x):
    """fp32 -> the nearest e4m3 value (ties to even), still as fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    mag = tl.abs(x)
    mag_bits = mag.to(tl.uint32, bitcast=True)
    # Keep 3 of fp32's 23 mantissa bits: add half an ulp (minus one unless the kept lsb is odd).
    normal = (mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) & 0xFFF00000
    subnormal = ((mag + _SUBNORMAL_MAGIC) - _SUBNORMAL_MAGIC).to(tl.uint32, bitcast=True)
    rounded = tl.where(mag >= _MIN_NORMAL, normal, subnormal)
    return (rounded | (bits & 0x80000000)).to(tl.float32, bitcast=True)
