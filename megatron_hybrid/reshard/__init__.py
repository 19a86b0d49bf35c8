"""The reshard core: how one copy of the actor's weights serves both the training and the rollout layout.

- :mod:`.plan`: the reshard plan of the in-place (micro-DP gather) layouts: which bytes move where, as regions per
  dtype; pure arithmetic;
- :mod:`.exchange`: the plan of every other layout pair (one all-to-all per dtype); pure arithmetic;
- :mod:`.executor`: the distributed side of both plans, the collectives of a switch;
- :mod:`.placement`: where every tensor lives and which ranges are backed;
- :mod:`.binding`: every rollout parameter pointed at its storage once (a view, blocks, a canonical tensor or FP8);
- :mod:`.aliased`: rollout modules that compute on training shards as blocks;
- :mod:`.rollout_model`: the rollout model, built without weights;
- :mod:`.communication`: pipeline send/recv, the last stage's broadcast and the in-place vocabulary gather.

:class:`megatron_hybrid.HybridEngine` (``engine.py``) sequences them. Importing this package imports none of them.
"""
