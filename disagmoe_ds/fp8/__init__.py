"""FP8 training: e4m3 values with power-of-two rowwise scales (``quantize``), FP8 GEMMs (``gemm``) and the
differentiable projections built from them (``projections``)."""

from disagmoe_ds.fp8.projections import fp8_grouped_mm, fp8_linear
from disagmoe_ds.fp8.quantize import E4M3, Quantized, dequantize, quantize

__all__ = ["E4M3", "Quantized", "dequantize", "fp8_grouped_mm", "fp8_linear", "quantize"]
