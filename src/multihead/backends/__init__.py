"""Attention kernels behind one signature, registered by name.

Built in, in the order ``backend="auto"`` considers them:

- ``sdpa``: torch's fused scaled_dot_product_attention, where it matches our semantics exactly.
- ``tiled``: our online-softmax kernel, O(n) memory, every mask, LSE, dropout, backward.
- ``spans``: on the CPU, torch's fused flash kernel run on groups of query rows, each over the keys its mask leaves
  alive: the skipped tiles of packed documents and windows as time; LSE (differentiable) and backward.
- ``flex``: torch's FlexAttention, typed masks lowered to mask_mod/score_mod and a BlockMask; compiled
  once per mask structure (any length), forward only on CPU; auto skips it until its kernel is compiled.
- ``materialized``: one pass that writes all weights once; auto's pick when every weight is asked for.
- ``reference``: the readable oracle, any dtype, everything (including gradients to a bias).
- ``paged``: keys and values in a page pool, read in place through a block table (``attention(..., pages=...)``);
  it serves paged calls only, and auto ranks it first for them.
"""

from multihead.backends import flex, materialized, paged, policy, reference, sdpa, spans, tiled
from multihead.backends.paged import PageTable
from multihead.backends.policy import DispatchPolicy, autotune, set_policy, use_policy
from multihead.backends.registry import (
    AttentionCall,
    Backend,
    BackendOutput,
    Capabilities,
    Explanation,
    available_backends,
    get_backend,
    register,
    unregister,
)

__all__ = [
    "AttentionCall",
    "DispatchPolicy",
    "PageTable",
    "autotune",
    "policy",
    "set_policy",
    "use_policy",
    "Backend",
    "BackendOutput",
    "Capabilities",
    "Explanation",
    "available_backends",
    "get_backend",
    "register",
    "unregister",
]

register("sdpa", sdpa.sdpa_attention, sdpa.CAPABILITIES, priority=10)
register("tiled", tiled.tiled_attention, tiled.CAPABILITIES, priority=20)
register("spans", spans.spans_attention, spans.CAPABILITIES, priority=22)
register("flex", flex.flex_attention_backend, flex.CAPABILITIES, priority=25)
register("materialized", materialized.materialized_attention, materialized.CAPABILITIES, priority=30)
register("reference", reference.reference_attention, reference.CAPABILITIES, priority=100)
register("paged", paged.paged_attention_backend, paged.CAPABILITIES, priority=110)
