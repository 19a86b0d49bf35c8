"""Hugging Face ⇄ Megatron checkpoint conversion, streamed.

- ``virtual.py``: tensors planned as rectangles of stored tensors and read in bands (the streaming).
- ``safetensors_io.py``: header checks, lazy reads, :class:`CheckpointError`; ``safetensors_writer.py``: a streaming
  safetensors writer.
- ``families.py``: Llama/Mistral/Qwen2/Qwen3/Qwen3-MoE/Qwen2-MoE configs ⇄
  :class:`~megatron_hybrid.megatron.models.GPTArchitecture`, and their tensors ⇄ megatron-core's (QKV interleave,
  [gate; up], vocabulary padding, router and experts).
- ``layout.py``: the Megatron-side checkpoint (per-rank safetensors in Megatron-LM's directory layout, routed
  experts in files of their own per expert-parallel and expert-tensor-parallel rank), its metadata, and
  :func:`load_megatron_checkpoint` into a live GPTModel at any TP/PP/EP/ETP.
- ``digests.py``: the sha256 of every file of a Megatron checkpoint, in its manifest; checked on every read.
- ``hf_checkpoint.py``: a Hugging Face directory: config, sharded weights, checks.
- ``conversions.py``: :func:`hf_to_megatron`, :func:`megatron_to_hf`.
- ``verify.py``: Hugging Face vs megatron-core logits.

Importing this package does not import megatron-core; the conversions do not need it.
"""

from .conversions import describe_os_error, hf_to_megatron, megatron_to_hf
from .layout import MegatronCheckpoint, load_megatron_checkpoint, read_architecture
from .safetensors_io import CheckpointError

__all__ = ["CheckpointError", "MegatronCheckpoint", "describe_os_error", "hf_to_megatron", "load_megatron_checkpoint",
           "megatron_to_hf", "read_architecture"]
