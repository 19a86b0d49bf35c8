"""Rotary embeddings of packed sequences without host syncs.

Needed by: megatron-core 0.16.1 and 0.19.x without Transformer Engine (checked on both). For a packed micro-batch
(``thd``: ``PackedSeqParams`` with ``cu_seqlens``) megatron-core's unfused ``_apply_rotary_pos_emb_thd`` reads the
sequence lengths to the host (``.tolist()``, and ``.item()`` or a tensor compared in an ``if``) and then rotates
one sequence at a time, computing ``cos`` and ``sin`` of its positions anew: in every attention layer, for the
query and the key, about a dozen kernels per sequence and two waits for the device. With Transformer Engine the
fused ``thd`` kernel does none of this; without it (our GPU image has no TE), a 28-layer model packed ~7 sequences
a micro-batch spends more time launching these kernels than the GPU spends on the layer's matrix multiplies.

:func:`packed_rope_without_host_syncs` replaces the module's ``_apply_rotary_pos_emb_thd`` (which
``apply_rotary_pos_emb`` calls by name) with :func:`apply_packed_rope`: each token's position in its own sequence
comes from ``cu_seqlens`` on the device (a ``searchsorted``), the angles at those positions are gathered once per
micro-batch and reused by every layer (the same ``cu_seqlens`` and ``freqs`` tensors are passed to all of them), and
``cos``, ``sin`` and the rotation are one set of element-wise kernels over the whole pack. The arithmetic per element is megatron-core's
(``cos(freqs) * mscale`` cast to the input's dtype, ``t * cos + rotate_half(t) * sin``), so on a GPU the output is
the same bits. Context parallelism (cp > 1) and MLA-style interleaving keep megatron-core's own function.

Applied by ``GPTArchitecture.build`` for models with rotary embeddings; idempotent and permanent for the process.
:func:`megatron_packed_rope` puts megatron-core's function back inside a ``with`` (benchmarks, tests).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

_ORIGINAL: list = []  # megatron-core's _apply_rotary_pos_emb_thd, once replaced
#: The last micro-batch's angles: (cu_seqlens, freqs, angles). Every layer of one pack passes the same two tensors;
#: holding them keeps their identity meaningful (a freed tensor's id could be reused).
_LAST: list = []


def _rope_utils():
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils


def packed_rope_without_host_syncs() -> bool:
    """Install :func:`apply_packed_rope` as megatron-core's ``thd`` rotary function; return whether it was installed
    now (False: it already was)."""
    module = _rope_utils()
    if module._apply_rotary_pos_emb_thd is apply_packed_rope:
        return False
    _ORIGINAL[:] = [module._apply_rotary_pos_emb_thd]
    module._apply_rotary_pos_emb_thd = apply_packed_rope
    return True


@contextlib.contextmanager
def megatron_packed_rope() -> Iterator[None]:
    """megatron-core's own ``thd`` rotary function inside the ``with`` (where this module's is installed)."""
    module = _rope_utils()
    ours = module._apply_rotary_pos_emb_thd
    if ours is apply_packed_rope:
        module._apply_rotary_pos_emb_thd = _ORIGINAL[0]
    try:
        yield
    finally:
        module._apply_rotary_pos_emb_thd = ours


def _original():
    return _ORIGINAL[0] if _ORIGINAL else _rope_utils()._apply_rotary_pos_emb_thd


def packed_positions(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each of ``tokens`` packed tokens' position in its own sequence (``cu_seqlens[i]:cu_seqlens[i + 1]`` is
    sequence i), computed on ``cu_seqlens``' device without reading it to the host."""
    cu = cu_seqlens.to(torch.int64)
    index = torch.arange(tokens, device=cu.device)
    sequence = torch.searchsorted(cu[1:].contiguous(), index, right=True)
    return index - cu[sequence]


def _angles(cu_seqlens: torch.Tensor, freqs: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each packed token's rotary angles, ``[T, 1, 1, rot_dim]`` (broadcast over the heads); cached for the layers
    of one pack. ``cos`` and ``sin`` are taken in each call, as megatron-core does, so that each layer keeps its own
    for the backward (the activations each layer saves stay what they were)."""
    if _LAST:
        cu, fr, angles = _LAST[0]
        if cu is cu_seqlens and fr is freqs and angles.size(0) == tokens:
            return angles
    if freqs.size(0) == tokens:  # megatron-core's "exact mapping": freqs holds every packed position already
        angles = freqs[:tokens]
    else:  # positions restart at every sequence
        angles = freqs.index_select(0, packed_positions(cu_seqlens, tokens).to(freqs.device))
    angles = angles.reshape(tokens, 1, 1, freqs.size(-1)).detach()
    _LAST[:] = [(cu_seqlens, freqs, angles)]
    return angles


def apply_packed_rope(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
                      multi_latent_attention: bool = False, mscale: float = 1.0, cp_group=None,
                      mla_rotary_interleaved: Optional[bool] = None) -> torch.Tensor:
    """megatron-core's ``_apply_rotary_pos_emb_thd`` (both versions' signatures: 0.16's ``multi_latent_attention``,
    0.19's ``mla_rotary_interleaved``) without host syncs; ``t`` is ``[T, heads, D]``."""
    interleave_mla = bool(mla_rotary_interleaved) or bool(multi_latent_attention)
    if cp_group is None:
        raise ValueError("cp_group must be provided for THD format RoPE")
    if cp_group.size() > 1 or interleave_mla or t.dim() != 3:
        kwargs = dict(rotary_interleaved=rotary_interleaved, mscale=mscale, cp_group=cp_group)
        if interleave_mla:
            kwargs["mla_rotary_interleaved" if mla_rotary_interleaved is not None else "multi_latent_attention"] = True
        return _original()(t, cu_seqlens, freqs, **kwargs)
    rot_dim = freqs.size(-1)
    angles = _angles(cu_seqlens, freqs, t.size(0))
    cos = (torch.cos(angles) * mscale).to(t.dtype)  # megatron-core's _apply_rotary_pos_emb_bshd, per element
    sin = (torch.sin(angles) * mscale).to(t.dtype)
    x = t.unsqueeze(1)  # [T, 1, heads, D], as megatron-core rotates it
    x, passed = x[..., :rot_dim], x[..., rot_dim:]
    rotated = x * cos + _rope_utils()._rotate_half(x, rotary_interleaved) * sin
    return torch.cat((rotated, passed), dim=-1).squeeze(1)
