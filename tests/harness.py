"""The test suite's way to start N gloo ranks: :mod:`megatron_hybrid.testing.ranks` (shared with bench/)."""

from megatron_hybrid.testing.ranks import DEFAULT_TIMEOUT_S, RankFailure, run_distributed, shutdown

__all__ = ["DEFAULT_TIMEOUT_S", "RankFailure", "run_distributed", "shutdown"]
