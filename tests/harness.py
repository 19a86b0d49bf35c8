"""Run a test body on N gloo ranks on CPU, with Megatron's parallel state set up around it.

Spawning N Python processes that import torch and megatron-core costs seconds on a 2-core machine, so ranks live
in a pool per world size that is reused across tests: each call sends the body to every rank, the ranks set up
``initialize_model_parallel(tensor, pipeline)`` inside :func:`megatron_hybrid.megatron.patches.cpu_gloo`, run it, tear
the parallel state down and report back. A failure on any rank fails the call with that rank's traceback; a rank
that does not answer within the timeout fails the call and the pool is killed (the next call starts a new one).

The rendezvous store is a ``TCPStore`` opened by this process on port 0, so the operating system picks a free
port: no fixed ports and no retry loops.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import gc
import os
import queue
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = float(os.environ.get("MH_TEST_TIMEOUT", "300"))


class RankFailure(AssertionError):
    """A rank raised, or did not answer in time."""


def _worker(rank: int, world_size: int, port: int, sys_path: list[str], inbox: Any, outbox: Any) -> None:
    sys.path[:] = sys_path
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid.megatron.patches import cpu_gloo

    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs, tp, pp, vpp, ep, etp = job
        # A rank that hangs prints where it hangs (to the test's stderr) just before the parent gives up.
        faulthandler.dump_traceback_later(max(DEFAULT_TIMEOUT_S - 10, 5), exit=False)
        try:
            with cpu_gloo():
                ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
                # Seeds the (CPU-backed) RNG tracker and the default generator alike on every rank.
                model_parallel_cuda_manual_seed(1234)
                try:
                    result = fn(*args, **kwargs)
                finally:
                    ps.destroy_model_parallel()
                    _destroy_subgroups(dist)
                    _reset_moe_loss_scale()
                    gc.collect()
            outbox.put((rank, True, result))
        except BaseException:  # report every failure, including assertion errors, to the parent
            outbox.put((rank, False, traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def _reset_moe_loss_scale() -> None:
    """megatron-core's MoE aux-loss scale is process-wide: a backward outside its schedules sets it to a 0-d tensor
    (0.16.1), and a later schedule then copies its [1]-shaped scale into that and fails. One job must not leave it to
    the next on the same rank."""
    import sys

    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None


def _destroy_subgroups(dist) -> None:
    """Free every process group but the world: a long-lived rank would otherwise pile up gloo groups (each with
    its own device, sockets and loop thread) test after test, and hundreds of loop threads starve the CPU."""
    import gc

    from torch.distributed import distributed_c10d as c10d

    gc.collect()  # engines and models of the finished job hold their groups through reference cycles
    world = c10d.GroupMember.WORLD
    for pg in list(c10d._world.pg_map):
        if pg is not world:
            dist.destroy_process_group(pg)


@dataclass
class _Pool:
    world_size: int
    procs: list
    inboxes: list
    outbox: Any
    store: Any

    def close(self, *, kill: bool = False) -> None:
        for p, box in zip(self.procs, self.inboxes):
            if kill:
                p.kill()
            elif p.is_alive():
                box.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


_POOLS: dict[int, _Pool] = {}


def _pool(world_size: int) -> _Pool:
    pool = _POOLS.get(world_size)
    if pool is not None and all(p.is_alive() for p in pool.procs):
        return pool
    if pool is not None:
        pool.close(kill=True)
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    inboxes, procs = [], []
    for rank in range(world_size):
        inbox = ctx.Queue()
        p = ctx.Process(target=_worker, args=(rank, world_size, store.port, list(sys.path), inbox, outbox),
                        daemon=True)
        p.start()
        inboxes.append(inbox)
        procs.append(p)
    pool = _Pool(world_size, procs, inboxes, outbox, store)
    _POOLS[world_size] = pool
    return pool


def shutdown() -> None:
    for ws in list(_POOLS):
        _POOLS.pop(ws).close()


atexit.register(shutdown)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, tensor_model_parallel_size: int = 1,
                    pipeline_model_parallel_size: int = 1, virtual_pipeline_model_parallel_size: int | None = None,
                    expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results in rank order.
    The parallel sizes are ``initialize_model_parallel``'s (expert TP defaults to the TP size, as there).

    ``fn`` must be importable by name (a module-level function) and its arguments picklable.
    """
    pool = _pool(world_size)
    job = (fn, args, kwargs, tensor_model_parallel_size, pipeline_model_parallel_size,
           virtual_pipeline_model_parallel_size, expert_model_parallel_size, expert_tensor_parallel_size)
    for box in pool.inboxes:
        box.put(job)
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    while len(results) + len(failures) < world_size:
        left = (deadline - datetime.datetime.now()).total_seconds()
        try:
            rank, ok, payload = pool.outbox.get(timeout=max(left, 0.01))
        except queue.Empty:
            missing = sorted(set(range(world_size)) - set(results))
            _POOLS.pop(world_size, None)
            pool.close(kill=True)
            raise RankFailure(f"ranks {missing} did not finish within {timeout_s:.0f} s"
                              + ("".join(f"\n{f}" for f in failures)))
        if ok:
            results[rank] = payload
        else:
            failures.append(f"--- rank {rank} ---\n{payload}")
            # The other ranks may now hang in a collective: give them a short grace period, then kill.
            deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=20))
    if failures:
        _POOLS.pop(world_size, None)
        pool.close(kill=True)
        raise RankFailure("\n".join(failures))
    return [results[r] for r in range(world_size)]
