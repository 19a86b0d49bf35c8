"""The megatron-core glue: what the package knows of megatron-core, in one room.

- :mod:`.compat`: every megatron-core version difference and internal we read (0.16.1 to 0.19.x);
- :mod:`.models`: :class:`~.models.GPTArchitecture`, dense or mixture-of-experts, under Megatron-LM's names, and
  the model it builds;
- :mod:`.sharding`: how a full tensor maps onto Megatron's tensor-parallel shards;
- :mod:`.patches`: version-guarded changes to megatron-core's behaviour, applied only by the caller
  (:func:`~.patches.cpu_gloo`: megatron-core on CPU with gloo).

It imports none of the layers built on it. Importing this package imports none of its modules.
"""
