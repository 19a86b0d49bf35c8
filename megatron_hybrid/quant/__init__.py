"""Quantization: FP8 rollout weights (``HybridEngine(rollout_weights="fp8")``).

- :mod:`.fp8`: which dense linear weights become float8 e4m3 with a scale per row, their quantization at every
  switch (from the binding's blocks) and the FP8 linears of the rollout model;
- :mod:`.fp8_kernels`: their Triton kernels (row quantization, the small-M weight-only FP8 matmul) and PyTorch
  references.

Below the inference package: nothing here imports :mod:`megatron_hybrid.inference` (the kernels' shared Triton
helpers are in :mod:`megatron_hybrid.kernels`). Importing this package imports neither module.
"""
