"""The reshard core: how one copy of the actor's weights serves both the training and the rollout layout.

- :mod:`.plan`: the reshard plan of the in-place (micro-DP gather) layouts: which bytes move where, as regions per
  dtype; pure arithmetic;
- :mod:`.exchange`: the plan of every other layout pair (one all-to-all per dtype); pure arithmetic;
- :mod:`.executor`: the distributed side of both plans, the collectives of a switch;
- :mod:`.assembly`: an engine's plans, placements and executors, plane by plane, made once;
- :mod:`.placement`: where every tensor lives and which ranges are backed;
- :mod:`.binding`: every rollout parameter pointed at its storage once (a view, blocks, a canonical tensor or FP8);
- :mod:`.aliased`: rollout modules that compute on training shards as blocks;
- :mod:`.rollout_model`: the rollout model, built without weights;
- :mod:`.communication`: pipeline send/recv, the last stage's broadcast and the in-place vocabulary gather.

:class:`megatron_hybrid.HybridEngine` (``engine.py``) sequences them.

The names below are the room's interface for generation and the recipe, the collectives of :mod:`.communication`:
``from megatron_hybrid.reshard import agree_max``. They are imported on first use, as the package root's names are,
so importing this package imports none of its modules.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "agree_max": ".communication",
    "broadcast_from_last": ".communication",
    "collective_device": ".communication",
    "gather_rows": ".communication",
    "gather_vocab": ".communication",
    "pipeline_peers": ".communication",
    "recv_from_previous": ".communication",
    "reduce_scatter_rows": ".communication",
    "send_to_next": ".communication",
    "sum_over": ".communication",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
