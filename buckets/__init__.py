"""Bucket policies and length-grouped batching (numpy only; no dependency on polyexec).

A bucket policy maps a sequence length to the padded size it runs at; each bucket in use is
one compiled program, so the policy trades padding against compiles.

>>> import buckets
>>> lengths = [5, 7, 7, 30, 31, 120]
>>> p = buckets.Optimal.fit(lengths, max_buckets=3)
>>> p
Optimal(sizes=(7, 31, 120))
>>> p.bucket_for(20), round(p.padding_efficiency(lengths), 3)
(31, 0.985)
>>> [(b.bucket_size, b.indices.tolist())
...  for b in buckets.batch_plan(lengths, p, max_tokens=128, shuffle=False)]
[(7, [0, 1, 2]), (31, [3, 4]), (120, [5])]
"""

from . import corpus
from ._batching import Batch, Overflow, PartialRows, batch_plan, batch_size_for, batches
from ._packing import (
    PackedBatch,
    PackedOverflow,
    Packing,
    balanced_fit,
    first_fit,
    joint_first_fit,
    packed_batch_plan,
    packed_batches,
    packed_cells,
)
from ._cost import Auto, CostModel, Prediction, predict, predict_packed
from ._policies import (
    BucketOverflowError,
    BucketPolicy,
    Fixed,
    Geometric,
    MultipleOf,
    Optimal,
    as_policy,
)
from ._stats import BucketRow, Report, report

__all__ = [
    "Auto",
    "Batch",
    "BucketOverflowError",
    "BucketPolicy",
    "BucketRow",
    "CostModel",
    "Fixed",
    "Geometric",
    "MultipleOf",
    "Optimal",
    "Overflow",
    "PackedBatch",
    "PackedOverflow",
    "Packing",
    "PartialRows",
    "Prediction",
    "Report",
    "as_policy",
    "balanced_fit",
    "batch_plan",
    "batch_size_for",
    "batches",
    "corpus",
    "first_fit",
    "joint_first_fit",
    "packed_batch_plan",
    "packed_batches",
    "packed_cells",
    "predict",
    "predict_packed",
    "report",
]
