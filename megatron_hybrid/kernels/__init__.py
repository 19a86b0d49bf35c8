"""Kernels the rooms share: the native copy ops and the Triton helpers.

- :mod:`.ops`: fused copies between many tensors and one flat buffer, and the block planners of resharding; the
  optional compiled extension ``megatron_hybrid.kernels._C`` (built from ``csrc/``) when it is there, a PyTorch
  reference otherwise;
- :mod:`.triton_helpers`: whether Triton is there and a tensor takes the Triton kernels, and launch helpers, for the
  kernels of :mod:`megatron_hybrid.inference` and :mod:`megatron_hybrid.quant`.

Imports nothing else of the package. Importing this package imports neither module.
"""
