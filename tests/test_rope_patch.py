"""Packed sequences' rotary embeddings without host syncs (megatron_hybrid.megatron.patches.rope) against
megatron-core's own ``_apply_rotary_pos_emb_thd``: the same bits forward and backward, no read of a tensor to the
host, and installed by the model builder."""

from __future__ import annotations

import pytest
import torch

from megatron_hybrid.megatron.patches import rope as patch


class _Group:
    """What the rotary functions ask of a context-parallel group: its size and this rank."""

    def __init__(self, size: int = 1) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def _freqs(positions: int, dim: int) -> torch.Tensor:
    """megatron-core's RotaryEmbedding table, ``[positions, 1, 1, dim]`` (base 10,000)."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def _megatron():
    from megatron.core.models.common.embeddings import rope_utils

    return patch._original() if rope_utils._apply_rotary_pos_emb_thd is patch.apply_packed_rope \
        else rope_utils._apply_rotary_pos_emb_thd


PACKS = [[7, 13, 1, 19], [40], [3, 37], [5] * 8, [1, 1, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot_fraction", [1.0, 0.5])
def test_same_bits_as_megatron_forward_and_backward(dtype, interleaved, rot_fraction):
    head_dim = 32
    freqs = _freqs(48, int(head_dim * rot_fraction))
    g = torch.Generator().manual_seed(3)
    for lengths in PACKS:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        t = torch.randn(sum(lengths), 4, head_dim, generator=g).to(dtype)
        grad = torch.randn(t.shape, generator=g).to(dtype)
        outs = []
        for fn in (_megatron(), patch.apply_packed_rope):
            x = t.clone().requires_grad_(True)
            out = fn(x, cu, freqs, rotary_interleaved=interleaved, cp_group=_Group())
            out.backward(grad)
            outs.append((out.detach(), x.grad))
        (ref, ref_grad), (ours, our_grad) = outs
        assert torch.equal(ref, ours), (lengths, (ref.float() - ours.float()).abs().max())
        assert torch.equal(ref_grad, our_grad), lengths


def test_every_position_restarts_at_its_sequence():
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    assert patch.packed_positions(cu, 9).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]


def test_exact_mapping_when_the_table_holds_every_packed_position():
    """megatron-core's case 1: a table as long as the pack is read at the packed positions, not per sequence."""
    lengths = [5, 6, 9]
    cu = torch.tensor([0, 5, 11, 20], dtype=torch.int32)
    freqs = _freqs(sum(lengths), 16) * 1.7  # not the per-sequence positions: a wrong mapping would show
    t = torch.randn(20, 2, 16)
    assert torch.equal(_megatron()(t, cu, freqs, cp_group=_Group()),
                       patch.apply_packed_rope(t, cu, freqs, cp_group=_Group()))


def test_no_tensor_is_read_to_the_host(monkeypatch):
    """The point of the patch: nothing waits for the device (megatron-core's reads the lengths, which the guard
    catches, so the guard works)."""
    cu = torch.tensor([0, 7, 20, 21, 40], dtype=torch.int32)
    freqs, t = _freqs(48, 32), torch.randn(40, 4, 32)

    def refuse(*args, **kwargs):
        raise RuntimeError("a tensor read to the host")

    patch._LAST.clear()
    for name in ("tolist", "item", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    patch.apply_packed_rope(t, cu, freqs, cp_group=_Group())
    with pytest.raises(RuntimeError, match="read to the host"):
        _megatron()(t, cu, freqs, cp_group=_Group())


def test_tables_follow_the_pack_and_the_dtype():
    """Each layer of one pack reuses its angles; another pack or table gets its own (and any dtype works)."""
    freqs = _freqs(48, 32)
    first = torch.tensor([0, 10, 30], dtype=torch.int32)
    second = torch.tensor([0, 20, 30], dtype=torch.int32)
    t = torch.randn(30, 2, 32)
    for cu, dtype in ((first, torch.float32), (first, torch.float32), (second, torch.float32),
                      (second, torch.bfloat16), (first, torch.float32)):
        x = t.to(dtype)
        assert torch.equal(patch.apply_packed_rope(x, cu, freqs, cp_group=_Group()),
                           _megatron()(x, cu, freqs, cp_group=_Group()))


def test_context_parallel_and_mla_keep_megatron_core_s_function(monkeypatch):
    calls = []
    monkeypatch.setattr(patch, "_original", lambda: lambda *a, **k: calls.append(k) or "megatron")
    cu, freqs, t = torch.tensor([0, 8], dtype=torch.int32), _freqs(8, 16), torch.randn(8, 2, 16)
    assert patch.apply_packed_rope(t, cu, freqs, cp_group=_Group(2)) == "megatron"
    assert patch.apply_packed_rope(t, cu, freqs, cp_group=_Group(), mla_rotary_interleaved=True) == "megatron"
    assert calls[-1]["mla_rotary_interleaved"] is True
    with pytest.raises(ValueError, match="cp_group"):
        patch.apply_packed_rope(t, cu, freqs)


def test_the_builder_installs_it_and_the_context_puts_megatron_core_s_back():
    from megatron.core.models.common.embeddings import rope_utils

    from bench.measure import one_rank
    from megatron_hybrid.megatron.models import GPTArchitecture

    patch.packed_rope_without_host_syncs()
    original = patch._original()
    rope_utils._apply_rotary_pos_emb_thd = original  # as in a fresh process
    try:
        arch = GPTArchitecture(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                               vocab_size=64, max_position_embeddings=32)
        with one_rank(torch.device("cpu")):
            arch.build(arch.transformer_config(use_cpu_initialization=True))
    finally:
        installed = rope_utils._apply_rotary_pos_emb_thd
        patch.packed_rope_without_host_syncs()
    assert installed is patch.apply_packed_rope
    assert patch.packed_rope_without_host_syncs() is False  # idempotent
    with patch.megatron_packed_rope():
        assert rope_utils._apply_rotary_pos_emb_thd is original
    assert rope_utils._apply_rotary_pos_emb_thd is patch.apply_packed_rope
