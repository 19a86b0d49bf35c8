"""megatron-core's ``dist_checkpointing`` (torch_dist format) on CPU: shard files written in the saving process.

Needed by: megatron-core 0.16.x (checked on 0.16.1; the writer is the same ``FileSystemWriterAsync`` through 0.19).

Its writer, ``FileSystemWriterAsync``, hands each rank's write buckets to processes forked for the purpose, and
collects their results through a ``multiprocessing.Manager`` queue, a server process spawned at the first save. On a
GPU that lets the writes overlap training once the tensors are staged to host memory. On CPU there is nothing to
stage or overlap, and the processes cost: a daemonic process (a test harness's rank) may not have children at all
(``AssertionError: daemonic processes are not allowed to have children``), a rank forks itself with gloo's threads
running, and the spawned server re-imports the main module and outlives a killed rank.

:func:`in_process_writes` is applied by :func:`~megatron_hybrid.megatron.patches.cpu_gloo`: the same per-bucket writer
(``write_preloaded_data``, fsync included) runs in the rank's process, one bucket after another, and reports through
an in-process queue, so the checkpoint files and the error handling (a failed write is reported to every rank by
``dist_checkpointing``) are those of megatron-core.
"""

from __future__ import annotations

import queue
from typing import Any

from packaging.version import Version

#: The megatron-core versions whose writer forks per bucket (checked on 0.16.1; same writer through 0.19.x).
_FORKING_WRITER_VERSIONS = (Version("0.16.1"), Version("0.20"))


def _write_buckets_in_process(transform_list: list, use_msc: bool, rank: int, write_buckets: list,
                              global_results_queue: Any) -> None:
    """``FileSystemWriterAsync.write_preloaded_data_multiproc`` without processes: the same results (a dict of
    write results per bucket, or the first bucket's exception) in ``global_results_queue``."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results, count = queue.Queue(), queue.Queue()
    out: Any = {}
    for i, bucket in enumerate(write_buckets):
        count.put(i)
        kwargs = {"use_msc": use_msc} if use_msc else {}
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, results, count, True, **kwargs)
        idx, result = results.get()
        if isinstance(result, Exception):
            out = result
            break
        out[idx] = result
    global_results_queue.put(out)


def in_process_writes() -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, replacement)`` for :func:`~megatron_hybrid.megatron.patches.cpu_gloo` to install for the
    duration of its block; ``[]`` for a megatron-core outside the checked versions or without that writer."""
    from megatron.core import __version__

    low, high = _FORKING_WRITER_VERSIONS
    if not low <= Version(__version__) < high:
        return []
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return []
    writer = getattr(filesystem_async, "FileSystemWriterAsync", None)
    if writer is None or not hasattr(writer, "write_preloaded_data_multiproc") \
            or not hasattr(filesystem_async, "_get_write_results_queue"):
        return []
    return [(writer, "write_preloaded_data_multiproc", staticmethod(_write_buckets_in_process)),
            (filesystem_async, "_get_write_results_queue", queue.Queue)]
