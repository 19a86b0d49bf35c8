"""The exchange plan's pure arithmetic (megatron_hybrid/reshard/exchange.py), against element-by-element counting.

A synthetic model (column- and row-parallel weights, SwiGLU's stride-2 fc1, replicated norms, an embedding on the
first stage and a tied output layer on the last) is described for every rank of a layout pair; each full tensor is
numbered element by element, and what a rank's rollout shard has that its training shard has not must be exactly
what the plan sends it, from ranks that hold it.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

from megatron_hybrid.layout import Grid, ParallelLayout
from megatron_hybrid.megatron.sharding import TPSpec, shard
from megatron_hybrid.reshard.exchange import RankTensors, arrange, build_exchange_plan, megatron_order, stage_layers
from megatron_hybrid.reshard.plan import ParamInfo

H, F, V = 16, 32, 64
# name -> (full shape, sharded, dim, stride)
LAYER = {"qkv": ((3 * H, H), True, 0, 1), "proj": ((H, H), True, 1, 1), "fc1": ((2 * F, H), True, 0, 2),
         "fc2": ((H, F), True, 1, 1), "norm": ((H,), False, 0, 1), "bias": ((3 * H,), True, 0, 1)}
EMB = "embedding.word_embeddings.weight"


def _tensors(layers: set[int], first: bool, last: bool, *, tied: bool) -> dict[str, tuple]:
    out = {f"decoder.layers.{i}.{n}": spec for i in sorted(layers) for n, spec in LAYER.items()}
    if first:
        out[EMB] = ((V, H), True, 0, 1)
    if last:
        out[EMB if tied else "output_layer.weight"] = ((V, H), True, 0, 1)
    return out


def _world(t, p, d, t_g, p_g, *, layers=4, chunks=1, tied=True, keeps_order=True):
    lay = ParallelLayout(t, p, d, t_g, p_g)
    grid = Grid.megatron_default(t, p, d)
    arrangement = arrange(lay, grid, num_layers=layers, chunks=chunks, keeps_order=keeps_order)
    train = stage_layers(layers, p, chunks)
    roll = stage_layers(layers, p_g)
    ranks, described = [], {}
    for rank, (i, s, _) in grid.coords():
        j, sg, _ = arrangement.coords[rank]
        held = _tensors(set(train[s]), s == 0, s == p - 1, tied=tied)
        needs = _tensors(set(roll[sg]), sg == 0, sg == p_g - 1, tied=tied)
        infos = []
        for name, (shape, sharded, dim, stride) in held.items():
            local = list(shape)
            if sharded:
                local[dim] //= t
            infos.append(ParamInfo(name, name, tuple(local), "float32", sharded, dim, stride))
        ranks.append(RankTensors(rank, i, j, tuple(infos), tuple(needs)))
        described[rank] = (i, j, held, needs)
    return lay, arrangement, ranks, described


def _ids(name: str, spec_tuple) -> torch.Tensor:
    shape = spec_tuple[0]
    return torch.arange(math.prod(shape)).view(shape) + (zlib.crc32(name.encode()) % 1000) * 10**6


def _shard(ids, spec_tuple, rank, size):
    _, sharded, dim, stride = spec_tuple
    return shard(ids, TPSpec(sharded, dim, stride), rank, size).flatten()


PAIRS = [((1, 1, 8), (1, 2)), ((2, 1, 4), (1, 2)), ((1, 2, 4), (2, 1)), ((1, 2, 4), (2, 4)), ((4, 2, 1), (2, 4)),
         ((8, 1, 1), (2, 2)), ((2, 2, 2), (1, 1)), ((2, 1, 4), (4, 2)), ((4, 1, 4), (2, 4)), ((2, 2, 4), (8, 1))]


@pytest.mark.parametrize("train,rollout", PAIRS)
@pytest.mark.parametrize("keeps_order", [True, False])
def test_plan_moves_exactly_the_missing_elements(train, rollout, keeps_order):
    (t, p, d), (t_g, p_g) = train, rollout
    lay, arrangement, ranks, described = _world(t, p, d, t_g, p_g, keeps_order=keeps_order)
    plan = build_exchange_plan(ranks, t=t, t_g=t_g)
    for rank, (i, j, held, needs) in described.items():
        expected = 0
        for name, spec in needs.items():
            need = _shard(_ids(name, spec), spec, j, t_g)
            have = _shard(_ids(name, spec), spec, i, t) if name in held else need[:0]
            expected += need.numel() - torch.isin(need, have).sum().item()
        assert plan.received_numel(rank).get("float32", 0) == expected, (rank, train, rollout)
        # The runs of every rollout tensor cover it exactly, in canonical order.
        for name, spec in needs.items():
            runs = plan.runs[rank][name]
            ids = _ids(name, spec)
            got = []
            for run in runs:
                if run.piece is None:
                    src_i = i
                else:
                    pc = plan.pieces[run.piece]
                    assert pc.dst == rank and pc.src != rank
                    src_i = plan.tp_of[pc.src]
                    assert name in described[pc.src][2], (pc, "sender does not hold it")
                local_shape = list(spec[0])
                if spec[1]:
                    local_shape[spec[2]] //= t
                local = _shard(ids, spec, src_i, t).view(local_shape)
                if spec[1]:
                    start, length = plan.local_range(name, src_i, run.part, run.lo, run.hi)
                    local = local.narrow(spec[2], start, length)
                got.append(local)
            canonical = _shard(ids, spec, j, t_g).view([s // t_g if spec[1] and k == spec[2] else s
                                                         for k, s in enumerate(spec[0])])
            rebuilt = torch.cat(got, dim=spec[2] if spec[1] else 0)
            assert torch.equal(rebuilt, canonical), (rank, name)
    # Nobody sends a piece it does not hold or to itself; every piece is needed once.
    seen = set()
    for pc in plan.pieces:
        assert (pc.dst, pc.key, pc.part, pc.lo) not in seen
        seen.add((pc.dst, pc.key, pc.part, pc.lo))


def test_in_place_pairs_move_what_the_paper_says():
    """For pairs inside the gather contract, needed − held is the HybridFlow volume (d_g − 1)/(t·p)·M per rank
    (the layers' TP-sharded tensors: embedding placement and replicated norms aside), with t_g | t and p_g | p."""
    for (t, p, d), (t_g, p_g) in [((4, 1, 2), (2, 1)), ((2, 2, 2), (1, 1)), ((4, 2, 1), (2, 1))]:
        lay, arrangement, ranks, described = _world(t, p, d, t_g, p_g, tied=False)
        # Drop the embedding and output layer: the formula counts the layers' M.
        ranks = [RankTensors(r.rank, r.tp, r.rollout_tp, tuple(x for x in r.held if "layers" in x.name),
                             tuple(n for n in r.needs if "layers" in n)) for r in ranks]
        plan = build_exchange_plan(ranks, t=t, t_g=t_g)
        model = 4 * sum(math.prod(s) for s, sharded, *_ in LAYER.values() if sharded)  # TP-replicated: held
        d_g = (t * p) // (t_g * p_g)
        # A TP-replicated tensor is missing only on the other training stages' layers of the rollout stage.
        replicated = (4 // p_g - 4 // p) * sum(math.prod(s) for s, sharded, *_ in LAYER.values() if not sharded)
        for rank in described:
            assert (plan.received_numel(rank)["float32"] - replicated) * (t * p) == (d_g - 1) * model


def test_senders_are_balanced():
    # 8,1 -> 2,2: every rank misses 3 of 4 TP shards of half the layers; each of the 8 sends the same amount.
    _, _, ranks, _ = _world(8, 1, 1, 2, 2)
    plan = build_exchange_plan(ranks, t=8, t_g=2)
    sent = [plan.sent_numel(r).get("float32", 0) for r in range(8)]
    assert max(sent) == min(sent) > 0, sent


@pytest.mark.parametrize("t,p,d,t_g,p_g,chunks", [(2, 1, 4, 4, 1, 1), (2, 2, 2, 4, 1, 1), (1, 2, 4, 2, 4, 1),
                                                 (2, 4, 1, 4, 2, 2), (4, 1, 2, 8, 1, 1)])
def test_arrangement(t, p, d, t_g, p_g, chunks):
    lay = ParallelLayout(t, p, d, t_g, p_g)
    grid = Grid.megatron_default(t, p, d)
    for keeps_order in (True, False):
        a = arrange(lay, grid, num_layers=8, chunks=chunks, keeps_order=keeps_order)
        cells = sorted(a.coords.values())
        replicas = t * p * d // (t_g * p_g)
        assert cells == sorted(itertools.product(range(t_g), range(p_g), range(replicas))), cells
        assert all(len(g) == t_g for g in a.tp_groups()) and all(len(g) == p_g for g in a.pp_groups())
        if not keeps_order:
            assert a.in_order()
    assert megatron_order(lay).in_order()
