"""``fp8.quantize``'s rowwise recipe inside Triton kernels: a slice's amax, its power-of-two scale and each value's
e4m3 byte, bit for bit what ``quantize`` makes of the same values.

The scale comes from the amax's bits and each e4m3 byte is built bit by bit (rounded to nearest, ties to even, in fp32
arithmetic; saturating at 448; NaN kept), with no logarithm and no FP8 cast: Triton's interpreter (the CPU tests)
casts to FP8 with another rounding than the GPU and loses NaN. Importing this module needs Triton.
"""

import triton
import triton.language as tl


@triton.jit
def pow2(exponent):
    """2^``exponent`` (int32, within float32's normal exponents) as float32, exact: built from its bits."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def amax_stats(amax, nan, AXIS: tl.constexpr, values):
    """The running ``(amax, nan)`` of the slices along ``AXIS`` of ``values`` after one more block of them (``nan``:
    1 where a slice holds a NaN; ``tl.max`` alone would not say, torch's amax does)."""
    size = tl.abs(values)
    return tl.maximum(amax, tl.max(size, AXIS)), tl.maximum(nan, tl.max((size != size).to(tl.int32), AXIS))


@triton.jit
def scale_exponent(amax, nan):
    """log2 of ``quantize.scale_of(amax)`` (amax >= 0): the smallest power of two s with 448 s >= amax, at least
    2^-126; 0 (a scale of 1) where amax is 0 or the slice holds a NaN (``nan``: torch's NaN amax), 128 (an infinite
    scale, ``pow2``) where amax is infinite. From amax's bits: amax = f 2^e with f in [1, 2) needs s = 2^(e - 8)
    where f <= 1.75 (448 = 1.75 * 2^8), else 2^(e - 7); no logarithm, so no rounding anywhere."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    exponent = tl.where(amax > 0, tl.maximum(exponent, -126), 0)
    return tl.where(nan > 0, 0, tl.where(bits == 0x7F800000, 128, exponent))  # 0x7F800000: +inf


@triton.jit
def inverse_scale(exponent):
    """1 / 2^``exponent``, exact; 0 for an infinite scale (x / inf: 0, or NaN for an infinite x, as torch's)."""
    return tl.where(exponent == 128, 0.0, pow2(-exponent))


@triton.jit
def e4m3_bits(x, inv_scale):
    """The e4m3 byte of ``x * inv_scale`` (exact: a power of two), saturated at +-448 and rounded to nearest, ties
    to even, as ``quantize.cast`` makes it (NaN stays NaN)."""
    scaled = x * inv_scale
    nan = scaled != scaled
    mag = tl.minimum(tl.abs(scaled), 448.0)
    exponent = tl.maximum((mag.to(tl.int32, bitcast=True) >> 23) - 127, -6)  # e4m3's normals start at 2^-6
    steps = mag * pow2(3 - exponent)  # in [0, 16): 3 mantissa bits; its nearest integer, ties to even, below
    steps = ((steps + 12582912.0) - 12582912.0).to(tl.int32)  # 12582912 = 1.5 * 2^23: float32's own rounding
    normal = steps >= 8  # 1.mmm, or a subnormal rounded up into the normals (or a normal into the next binade)
    code = tl.where(normal, ((exponent + 7 + (steps >> 4)) << 3) | (steps & 7), steps)
    sign = (scaled.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 7  # -0.0 too, as torch's cast
    return (tl.where(nan, 0x7F, code) | sign).to(tl.uint8)
