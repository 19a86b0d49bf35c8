import os

# Tests run on the CPU; keep each process single-threaded so that 8 ranks share 2 cores sanely.
os.environ.setdefault("OMP_NUM_THREADS", "1")
