"""Fused kernels for the capped cache, each with its torch reference beside it (DESIGN "Kernels").

Every op runs Triton when it imports and the tensors are on CUDA (or ``TRITON_INTERPRET=1`` /
``EDGEKV_TRITON=1``), its torch reference otherwise; ``EDGEKV_TRITON=0`` forces the reference. Triton is
optional: without it everything here still works, in torch.

    attention_mass  chunk attention + per-key attention mass, no Q·Kᵀ in memory (StateKV App. 0.B.1)
    quantized_attention  chunk/decode attention read from an 8-bit cache's codes and scales (keys rotated
                    to their temporal positions in the kernel)
    tar_scores      TaR, same-patch cosine against the recent frames (InfiniPot-V eq. 4)
    value_norms, layer_cv, pooled_van   VaN with layer-adaptive pooling (InfiniPot-V Alg. 2 l.14-22)
    compact_        in-place gather of K, V and slot metadata by keep indices (CappedKVCache.compact)

One CPU kernel is C rather than Triton: ``edgekv.kernels.cpu_gemv`` (bf16 matrix-vector product for decode,
built with the system compiler at first use; ``model.decode_route``), imported where it is used.
"""

from edgekv.kernels._triton import triton_available, use_triton
from edgekv.kernels.attention_mass import attention_mass, attention_mass_reference
from edgekv.kernels.compaction import METADATA_FIELDS, TAIL_FILL, compact_, compact_reference_
from edgekv.kernels.quant_attention import quantized_attention, quantized_attention_reference
from edgekv.kernels.tar import tar_scores, tar_scores_reference
from edgekv.kernels.van import (
    layer_cv,
    layer_cv_reference,
    pooled_van,
    pooled_van_reference,
    value_norms,
    value_norms_reference,
)

__all__ = [
    "METADATA_FIELDS",
    "TAIL_FILL",
    "attention_mass",
    "attention_mass_reference",
    "compact_",
    "compact_reference_",
    "layer_cv",
    "layer_cv_reference",
    "pooled_van",
    "pooled_van_reference",
    "quantized_attention",
    "quantized_attention_reference",
    "tar_scores",
    "tar_scores_reference",
    "triton_available",
    "use_triton",
    "value_norms",
    "value_norms_reference",
]
