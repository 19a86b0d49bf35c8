"""The collectives of a switch behind one interface: ``torch.distributed`` across processes, or every rank of a world
held in one process.

The reshard plan is pure arithmetic (:mod:`megatron_hybrid.reshard.plan`, :mod:`megatron_hybrid.reshard.exchange`); what
moves the bytes is the executor (:mod:`megatron_hybrid.reshard.executor`), and what it needs from the world is small:
this rank's number, the world's size and four collectives (``all_gather_object`` once, to plan;
``all_gather_into_tensor``, ``broadcast`` and ``all_to_all_single`` at every switch). :class:`TorchTransport` is those
calls as the engine has always made them; :class:`InProcessWorld` holds every rank of a world in one process, one thread
per rank, and performs the same collectives by copying, so that the executor's own code can run for every rank of a
layout in milliseconds (issue 48: a check over the whole layout space). Megatron-core's refit keeps its transports
pluggable the same way (``resharding/copy_services``: nccl, gloo, nvshmem, nixl).

A group is whatever the rollout groups hand out: a ``ProcessGroup`` for torch, the tuple of its global ranks in
group-rank order for the in-process world.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from .megatron import compat


class Transport(Protocol):
    """What the executor asks of the world (see the module's docstring)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather_object(self, obj: Any, group: Any) -> list[Any]:
        """Every member's ``obj``, in group-rank order."""

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
        """Member i's ``inp`` into the i-th of ``out``'s equal parts, on every member."""

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> None:
        """Global rank ``src``'s ``tensor`` into every member's, in place."""

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                          in_splits: Sequence[int], group: Any) -> None:
        """``inp`` cut by ``in_splits`` (one part per member, in group-rank order) sent; ``out`` cut by
        ``out_splits`` receives each member's part for this rank."""


class TorchTransport:
    """``torch.distributed``: the calls the engine makes across processes (NCCL or gloo)."""

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def all_gather_object(self, obj: Any, group: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
        compat.all_gather_into_tensor(out, inp, group=group)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> None:
        dist.broadcast(tensor, src=src, group=group)

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                          in_splits: Sequence[int], group: Any) -> None:
        dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=group)


#: The transport of a process in a ``torch.distributed`` world.
TORCH = TorchTransport()


class WorldBroken(RuntimeError):
    """A rank of an :class:`InProcessWorld` failed or a collective waited past the timeout: the other ranks stop
    with this error instead of waiting forever."""


class InProcessWorld:
    """Every rank of a world of ``world_size`` in this process, one thread per rank (:meth:`run`); each rank's
    :meth:`transport` performs the collectives by copying from the other ranks' inputs.

    A collective is matched by its group and its count on that group: every member calls the collectives of a
    group in the same order (as torch requires too), so the n-th call on a group is the same collective on every
    member. Inputs are copied when deposited (a member may overwrite its input while others read it: an in-place
    all-gather's input is a slice of its output). ``timeout`` (seconds): a collective that waits longer, or any
    collective after another rank failed, raises :class:`WorldBroken`.
    """

    def __init__(self, world_size: int, *, timeout: float = 120.0) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size ({world_size!r}) must be a positive integer")
        self.world_size, self.timeout = world_size, timeout
        self._cond = threading.Condition()
        self._posted: dict[tuple[tuple[int, ...], int], dict[int, Any]] = {}  # (group, n) -> rank -> deposit
        self._taken: dict[tuple[tuple[int, ...], int], int] = {}  # how many members have read a collective's deposits
        self._calls: dict[tuple[int, tuple[int, ...]], int] = {}  # (rank, group) -> collectives called on it
        self._broken: Optional[str] = None
        self.collectives = 0  # collectives completed (counted once, by their last member)

    def transport(self, rank: int) -> "InProcessTransport":
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank ({rank}) must be in [0, {self.world_size})")
        return InProcessTransport(self, rank)

    def run(self, fn: Callable[["InProcessTransport"], Any]) -> list[Any]:
        """``fn(transport)`` for every rank, each in its own thread; their results in rank order. The first
        failure (in rank order) is raised after every thread has ended; the others then fail with
        :class:`WorldBroken`."""
        results: list[Any] = [None] * self.world_size
        errors: list[Optional[BaseException]] = [None] * self.world_size

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.transport(rank))
            except BaseException as exc:  # noqa: BLE001 (re-raised by run, in the caller's thread)
                errors[rank] = exc
                self.abort(f"rank {rank} failed: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True)
                   for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = next((e for e in errors if e is not None and not isinstance(e, WorldBroken)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results

    def abort(self, why: str) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = why
            self._cond.notify_all()

    def exchange(self, rank: int, group: Sequence[int], deposit: Any, what: str) -> list[Any]:
        """Every member's ``deposit`` for this collective on ``group`` (global ranks in group order), in group
        order, once all have arrived."""
        key_group = tuple(int(r) for r in group)
        if rank not in key_group:
            raise ValueError(f"{what}: rank {rank} is not a member of group {list(key_group)}")
        with self._cond:
            n = self._calls.get((rank, key_group), 0)
            self._calls[(rank, key_group)] = n + 1
            key = (key_group, n)
            self._posted.setdefault(key, {})[rank] = deposit
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._broken is not None
                                       or len(self._posted[key]) == len(key_group), timeout=self.timeout):
                self._broken = self._broken or (f"{what} on ranks {list(key_group)} waited {self.timeout:g} s: "
                                                f"ranks {sorted(set(key_group) - set(self._posted[key]))} did "
                                                "not arrive")
                self._cond.notify_all()
            if self._broken is not None:
                raise WorldBroken(f"{what} on ranks {list(key_group)}: {self._broken}")
            got = [self._posted[key][r] for r in key_group]
            self._taken[key] = self._taken.get(key, 0) + 1
            if self._taken[key] == len(key_group):  # the last reader frees the deposits
                del self._posted[key], self._taken[key]
                self.collectives += 1
            return got


class InProcessTransport:
    """One rank of an :class:`InProcessWorld`; groups are tuples of global ranks in group-rank order."""

    def __init__(self, world: InProcessWorld, rank: int) -> None:
        self.world, self._rank = world, rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    def all_gather_object(self, obj: Any, group: Any) -> list[Any]:
        # Each member gets its own copy, as unpickling on every rank would give.
        return [copy.deepcopy(o) for o in self.world.exchange(self._rank, group, obj, "all_gather_object")]

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
        parts = self.world.exchange(self._rank, group, inp.detach().clone(), "all_gather_into_tensor")
        if out.numel() != inp.numel() * len(parts):
            raise ValueError(f"all_gather_into_tensor: out has {out.numel()} elements, expected "
                             f"{len(parts)} x {inp.numel()}")
        flat = out.view(-1)
        with torch.no_grad():
            for i, part in enumerate(parts):
                flat[i * inp.numel(): (i + 1) * inp.numel()].copy_(part.reshape(-1))

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> None:
        mine = tensor.detach().clone() if self._rank == src else None
        parts = self.world.exchange(self._rank, group, mine, "broadcast")
        if self._rank != src:
            with torch.no_grad():
                tensor.copy_(parts[list(group).index(src)])

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                          in_splits: Sequence[int], group: Any) -> None:
        members = list(group)
        if len(in_splits) != len(members) or len(out_splits) != len(members):
            raise ValueError(f"all_to_all_single: {len(in_splits)} send and {len(out_splits)} receive splits for "
                             f"a group of {len(members)}")
        sent, off = [], 0
        for n in in_splits:
            sent.append(inp[off: off + n].detach().clone())
            off += n
        everyone = self.world.exchange(self._rank, group, sent, "all_to_all_single")
        me = members.index(self._rank)
        off = 0
        with torch.no_grad():
            for i, n in enumerate(out_splits):
                piece = everyone[i][me]
                if piece.numel() != n:
                    raise ValueError(f"all_to_all_single: rank {members[i]} sends {piece.numel()} elements to "
                                     f"rank {self._rank}, which expects {n}")
                out[off: off + n].copy_(piece)
                off += n
