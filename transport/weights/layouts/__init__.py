"""Layouts as data: which slice of which global tensor each trainer rank holds, what each
destination tensor is made of, and the byte runs that carry one into the other.

A :class:`SourceLayout` describes every rank of a sharded trainer at once (each rank computes
the same layout from the same rule, so no rank needs to ask another): a tensor is replicated
(every rank holds it whole) or split along one dim into disjoint, possibly uneven, shards. A
destination layout maps each destination tensor to :class:`DestTensor`: pieces of source tensors
(a slice along one dim each) stacked along one dim, which says a full copy, a tensor-parallel
shard, a fused parameter (vLLM's ``qkv_proj`` is q, k and v of one TP rank stacked along dim 0)
or a rename. :func:`check` refuses a pair that does not fit (a destination not covered, shards
that overlap, shapes or dtypes that disagree) with every problem named; :func:`plan` gives one
rank's :class:`Run` list, computed once and replayed every version. A replicated source is
written by exactly one rank per piece, the pieces dealt round robin over the ranks. The modules:
``types`` (the value types), ``rules`` (what a pair must satisfy), ``planning`` (checks, runs,
the common destination layouts), ``encoding`` (a declared layout in the store), ``flat`` (tensors as
views of one buffer, and the copies between two such sets), ``convert`` (dtype conversions on the
way). Import the names ``transport.weights`` exports from there (one path for each name), the
rest from here.
"""

from transport.weights.layouts.convert import fp8_blockwise
from transport.weights.layouts.flat import flat_like
from transport.weights.layouts.planning import (
    apply_runs,
    check,
    check_dest,
    check_shards,
    fp8,
    full_copy,
    plan,
    plan_all,
    plan_quant,
    tensors_for,
    tp_shard,
)
from transport.weights.layouts.types import (
    Box,
    DestTensor,
    Piece,
    Quant,
    Run,
    Slice,
    SourceLayout,
    SourceTensor,
)

__all__ = [
    "Box",
    "DestTensor",
    "Piece",
    "Quant",
    "Run",
    "Slice",
    "SourceLayout",
    "SourceTensor",
    "apply_runs",
    "check",
    "flat_like",
    "fp8_blockwise",
    "check_dest",
    "check_shards",
    "fp8",
    "full_copy",
    "plan",
    "plan_all",
    "plan_quant",
    "tensors_for",
    "tp_shard",
]
