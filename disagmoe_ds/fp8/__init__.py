"""FP8 training: e4m3 values with power-of-two rowwise scales (``quantize``), FP8 GEMMs (``gemm``), the
differentiable projections built from them (``projections``) and which projections take them (``shapes``, pure Python:
importing this package loads no torch, so the planner and the config read the same rule)."""
