"""Which errors say two arrays' shapes disagree: the sign that a model computed with a parameter shard.

JAX raises these as plain ``TypeError`` / ``ValueError``, the same types as any other bad
argument, so the message is the only signal. One table, one entry a message; each entry is checked
against the error the real library raises (tests/test_shape_errors.py), so a JAX that rewords one
fails there, not silently in the step's notes.
"""

from __future__ import annotations

import re

# (what raises it, the exception type, a pattern of its message), checked with re.search.
SHAPE_MISMATCHES: tuple[tuple[str, type[Exception], str], ...] = (
    ("a matmul / dot_general", TypeError, r"dot_general requires contracting dimensions to have the same shape"),
    ("an elementwise lax op", TypeError, r"got incompatible shapes for broadcasting"),
    ("numpy-style broadcasting", ValueError, r"Incompatible shapes for broadcasting"),
    ("a reshape", TypeError, r"cannot reshape array of shape"),
    ("a concatenate", TypeError, r"Cannot concatenate arrays with shapes that differ"),
    ("an einsum", ValueError, r"Size of label '\w+' for operand \d+ \(\d+\) does not match previous terms"),
    ("a convolution", ValueError, r"lhs feature dimension size divided by feature_group_count must equal the rhs"),
)


def is_shape_mismatch(err: BaseException) -> bool:
    """Whether ``err`` is one of `SHAPE_MISMATCHES`."""
    text = str(err)
    return any(isinstance(err, kind) and re.search(pattern, text) for _, kind, pattern in SHAPE_MISMATCHES)
