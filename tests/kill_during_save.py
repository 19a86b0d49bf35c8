"""``torchrun --nproc_per_node N tests/kill_during_save.py RECIPE-ARGS``: examples/ppo/train_ppo.py with rank 1
SIGKILLed in the middle of its second ``--save``, once part of its first shard file is written (what a crash, an
out-of-memory kill or a pre-empted node leaves). Used by tests/test_checkpoint.py."""

import os
import runpy
import signal
import sys

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples", "ppo", "train_ppo.py")
_write = FileSystemWriterAsync.write_preloaded_data


def _killing_write(transform_list, local_proc_idx, write_bucket, *args, **kwargs):
    file_name = str(write_bucket[0])
    if os.environ["RANK"] == "1" and f"{os.sep}.iter_0000002.tmp{os.sep}" in file_name:
        with open(file_name, "wb") as f:
            f.write(b"part of a shard")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    return _write(transform_list, local_proc_idx, write_bucket, *args, **kwargs)


if __name__ == "__main__":
    FileSystemWriterAsync.write_preloaded_data = staticmethod(_killing_write)
    sys.argv = [RECIPE, *sys.argv[1:]]
    runpy.run_path(RECIPE, run_name="__main__")
