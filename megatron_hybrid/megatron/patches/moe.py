"""MoE routing without Transformer Engine.

Needed by: megatron-core 0.16.x (checked on 0.16.1). ``megatron.core.transformer.moe.moe_utils`` imports
``te_general_gemm`` (and the fused MoE kernels) from Transformer Engine inside a ``try``, and defines nothing in
the ``except ImportError`` branch. Every fused kernel is used behind ``if not HAVE_TE or kernel is None``, but
``RouterGatingLinearFunction.forward`` (the router's gating GEMM, used by every ``TopKRouter``) tests
``if te_general_gemm is not None``: without Transformer Engine that is a ``NameError`` on the first MoE forward,
on any device. Megatron-LM's main branch later binds all those names to ``None`` when TE is missing; this patch
does the same for ``te_general_gemm``, so the router takes its own plain ``torch.mm`` / ``addmm`` branch (the
one it takes for ``router_dtype=fp64``). The numerics are megatron-core's own fallback; nothing else changes.
"""

from __future__ import annotations

from packaging.version import Version

#: The megatron-core versions that may lack the name (0.16.1 does; newer ones define it, which the check below
#: sees, so on them this patch does nothing).
_TE_GENERAL_GEMM_VERSIONS = (Version("0.16.1"), Version("0.20"))


def moe_router_without_te() -> bool:
    """Bind ``moe_utils.te_general_gemm`` to ``None`` where Transformer Engine is missing and the name is not
    defined; return whether it was bound now.

    Not a CPU patch: a GPU image without Transformer Engine fails the same way, so it is not part of
    :func:`megatron_hybrid.megatron.patches.cpu_gloo`. ``GPTArchitecture.build`` applies it when it builds a model with
    experts (a dense model never imports the router), which is before any MoE forward can run. It is idempotent
    and permanent for the process: it only defines a name the module already treats as optional.
    """
    import megatron.core
    from megatron.core.transformer.moe import moe_utils

    low, high = _TE_GENERAL_GEMM_VERSIONS
    if not low <= Version(megatron.core.__version__) < high:
        return False
    if getattr(moe_utils, "HAVE_TE", False) or hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True
