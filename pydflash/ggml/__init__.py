"""pydflash's bindings to its own ggml build (cffi, ABI mode).

Tiers: `_ffi` is the generated 1:1 layer (private), `core` the thin owning layer exported here, and
`ext` the checked wrappers of pydflash's own ops.
"""
from .core import (Allocator, Backend, Buffer, Context, Event, GGMLError, Graph, HostBuffer, InputBlock, Op, Readback,
                   Tensor, Type, block_size, devices, quantize, row_size, type_of)
from .ext import (QMATMUL_F16, QMATMUL_F16_FAMILY_TYPES, QMATMUL_GATES, QMATMUL_HALF_PITCH, QMATMUL_MAX_COLS,
                  QMATMUL_ROW_TILES, QMATMUL_STREAM_TYPES, QMATMUL_TYPES, argmax_first, check_parents,
                  flash_attn_ordered, gated_delta_net_path, gated_delta_net_tree, gated_delta_net_tree_persist,
                  gated_delta_net_tree_steps, gdn_conv_tree, gdn_gates, qmatmul, qmatmul_prepare, qmatmul_prepared,
                  qmatmul_prepared_shape, qmatmul_streams, qmatmul_swiglu_prepared, sample_probs, sample_tokens,
                  set_parents, ssm_conv_tree, ssm_conv_tree_split, TOP_K_LOGP_MAX_K, top_k_logp)

__all__ = ["Allocator", "Backend", "Buffer", "Context", "Event", "GGMLError", "Graph", "HostBuffer", "InputBlock", "Op",
           "Readback", "Tensor", "Type", "block_size",
           "devices", "quantize", "row_size", "type_of",
           "QMATMUL_F16", "QMATMUL_F16_FAMILY_TYPES", "QMATMUL_GATES", "QMATMUL_HALF_PITCH", "QMATMUL_MAX_COLS",
           "QMATMUL_ROW_TILES",
           "QMATMUL_STREAM_TYPES", "QMATMUL_TYPES", "argmax_first",
           "check_parents", "flash_attn_ordered",
           "gated_delta_net_path", "gated_delta_net_tree", "gated_delta_net_tree_persist", "gated_delta_net_tree_steps",
           "gdn_conv_tree", "gdn_gates",
           "qmatmul", "qmatmul_prepare", "qmatmul_prepared", "qmatmul_prepared_shape", "qmatmul_streams", "qmatmul_swiglu_prepared",
           "sample_probs", "sample_tokens", "set_parents", "ssm_conv_tree",
           "ssm_conv_tree_split",
           "TOP_K_LOGP_MAX_K", "top_k_logp"]
