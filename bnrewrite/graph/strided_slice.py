"""TensorFlow's strided-slice index arithmetic (ValidateStridedSliceOp, BuildDenseSpec) on
plain integers, for the StridedSlice shape rule (bnrewrite.graph.shape_rules): apart because it is
the one rule with arithmetic of its own. Invariant: what TensorFlow refuses raises ValueError.
"""

from __future__ import annotations


def dense_spec(rank: int, steps: list[int], begin: list[int] | None, end: list[int] | None,
               masks: dict[str, int]) -> tuple[list[tuple[int, int, int, bool, bool, bool]], list[int | str]]:
    """(begin, end, stride, begin masked, end masked, shrunk) for each input dimension, and where
    each output dimension comes from (an input dimension, "new" or "shrink"): BuildDenseSpec."""
    ellipsis, new_axis = masks["ellipsis_mask"], masks["new_axis_mask"]
    if ellipsis & (ellipsis - 1):
        raise ValueError("several ellipses")
    count = len(steps)
    after = sum(1 for i in range(count) if new_axis & (1 << i) and ellipsis & ((1 << i) - 1))
    if not ellipsis:
        ellipsis, count = 1 << count, count + 1
    dims: list[tuple[int, int, int, bool, bool, bool]] = []
    gather: list[int | str] = []
    for i in range(count):
        if ellipsis & (1 << i):
            while len(dims) < min(rank - (count - i) + 1 + after, rank):
                gather.append(len(dims))
                dims.append((0, 0, 1, True, True, False))
        elif new_axis & (1 << i):
            gather.append("new")
        else:
            if len(dims) == rank:
                raise ValueError("more indices than dimensions")
            shrink = bool(masks["shrink_axis_mask"] & (1 << i))
            gather.append("shrink" if shrink else len(dims))
            dims.append((begin[i] if begin else 0, end[i] if end else 0, steps[i],
                         bool(masks["begin_mask"] & (1 << i)), bool(masks["end_mask"] & (1 << i)), shrink))
    return dims, gather


def interval(dim: int, begin: int, end: int, stride: int, begin_masked: bool, end_masked: bool,
             shrink: bool, valid: bool) -> int:
    """The size of one dimension of a strided slice (Step 3 of ValidateStridedSliceOp)."""
    if stride == 0 or shrink and stride <= 0:
        raise ValueError("bad stride")
    if dim < 0:
        return 1 if shrink else -1
    if valid and shrink:
        start = begin + dim if begin < 0 else begin
        if not 0 <= start < dim:
            raise ValueError("slice index out of bounds")
        length = 1
    elif valid:
        low, high = (0, dim) if stride > 0 else (-1, dim - 1)

        def canonical(index: int, masked: bool, c: int) -> int:
            if masked:
                return (low, high)[c] if stride > 0 else (low, high)[1 - c]
            forward = index + dim if index < 0 else index
            return min(max(forward, low), high)

        length = canonical(end, end_masked, 1) - canonical(begin, begin_masked, 0)
    elif shrink:
        length = 1
    elif begin_masked and end_masked:
        length = dim if stride > 0 else -dim
    else:
        return -1
    if length == 0 or (length < 0) != (stride < 0):
        return 0
    return -(-abs(length) // abs(stride))  # same signs here: C++'s l / s + (l % s != 0)
