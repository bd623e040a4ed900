"""Expert-parallel MoE over GIN / LSA, inside jax.shard_map over the expert axis.

    sent = jaxgin.moe.dispatch(x, topk_ids, topk_weights, num_experts=E, axis_name="ep")
    h = jax.lax.ragged_dot(sent.x, w1, sent.expert_counts)   # rows grouped by local expert
    ...
    y = jaxgin.moe.combine(expert_out, sent.handle)            # [T, H], weighted sum per token
    y = jaxgin.moe.moe_layer(x, router_logits, w1, w2, top_k=8, axis_name="ep")

dispatch sends every token once per GPU that owns one of its experts (not once per expert) and
the receiving GPU copies it to each of its experts' rows; combine reduces a token's entries on
each expert GPU and sends one row back per GPU. On GPUs each is one Triton kernel (tritongin;
dispatch's routing arithmetic is one more up to 256 tokens per GPU, XLA's fusions above): GPUs
of the same host are reached with NVLink stores, GPUs of other hosts with GIN puts (a few large
puts per peer and call); on CPU (reference mode) the same layout comes from jax.lax.all_to_all.
dispatch(..., fp8=True) sends rows as e4m3 with a scale per 128 values (jaxgin.moe.fp8).
jaxgin.moe.ragged.moe_layer is the same layer on jax.lax.ragged_all_to_all, for comparison.
"""

from jaxgin.moe import fp8, ragged
from jaxgin.moe.exchange import Dispatched, Handle, combine, dispatch
from jaxgin.moe.layer import moe_layer, router

__all__ = ["Dispatched", "Handle", "combine", "dispatch", "fp8", "moe_layer", "ragged", "router"]
