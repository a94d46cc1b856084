"""What a scan of the graph finds: batch-norm sites (`Site`, with the moving-average `Update`s
they feed), the ops left alone and why (`Skip`), and the `Census` that holds them.

These are the facts every later stage reads (functions, plan, passes, report), kept apart from
the matching that finds them (`sites.py`) so those stages import records, not pattern matchers.
Nothing here reads a graph: a `Site`'s properties derive from its fields alone.

Invariant: a batch norm found stays accounted for. A stage that takes a site out of
`Census.sites` puts it in `skips` (or `not_run`) with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorflow.core.framework import types_pb2

from bnrewrite.graph.index import Device


@dataclass(frozen=True)
class Update:
    """An op that writes a batch statistic of a site into `variable`."""

    node: str
    variable: str
    statistic: str  # "mean" or "variance"


@dataclass(frozen=True)
class Site:
    """One training-mode batch norm in one tower.

    kind "fused": `name` is the FusedBatchNorm* op and `grads` its gradient ops.
    kind "moments": `name` is the Mean that `tf.nn.moments` makes, `variance` the Mean of
    the squared differences, and `grads`/`variance_grads` the Reshape (BroadcastTo, for an
    input of unknown shape) nodes through which each `tf.gradients` call feeds the gradients
    of mean and variance back (aligned).
    `scale_var`/`offset_var`: the variables the normalization reads as scale and offset (for
    moments, those of the tf.nn.batch_normalization its statistics feed), None if none;
    copies of a layer in several towers share them.
    """

    name: str
    op: str
    data_format: str
    dtype: int
    stat_dtype: int
    epsilon: float
    avg_factor: float
    device: Device
    grads: tuple[str, ...]
    scale_var: str | None
    offset_var: str | None
    channels: int | None = None
    updates: tuple[Update, ...] = field(default=())
    kind: str = "fused"
    variance: str = ""
    axes: tuple[int, ...] = ()
    keep_dims: bool = True
    variance_grads: tuple[str, ...] = ()
    #: Moments sites: the tensor the moments are taken of (the passes replace the Means that read it).
    x: str = ""
    #: (node, output, statistic) outside the site's function body that carry its statistics
    #: (the outputs of the If whose branch holds it); moving-average updates are found from these too.
    exits: tuple[tuple[str, int, str], ...] = ()
    #: Functional control-flow ops (If, While, ...) its statistics enter on their way to
    #: updates: moving-average updates inside their functions cannot be found.
    opaque: tuple[str, ...] = ()

    @property
    def channel_axis(self) -> int:
        return 1 if self.data_format.startswith("NC") else len(self.data_format) - 1

    @property
    def channel_shape(self) -> list[int]:
        """Shape that lines a per-channel [C] vector up with the data; [] when it lines up as it
        is (channels last)."""
        if self.channel_axis == len(self.data_format) - 1:
            return []
        shape = [1] * len(self.data_format)
        shape[self.channel_axis] = -1
        return shape

    @property
    def reduce_axes(self) -> list[int]:
        if self.kind == "moments":
            return list(self.axes)
        return [a for a in range(len(self.data_format)) if a != self.channel_axis]

    @property
    def statistics(self) -> list[tuple[str, int, str]]:
        """(node, output, statistic) of the batch statistics that moving averages read."""
        if self.kind == "moments":
            return [(self.name, 0, "mean"), (self.variance, 0, "variance"), *self.exits]
        return [(self.name, 1, "mean"), (self.name, 2, "variance"), *self.exits]

    @property
    def dtype_name(self) -> str:
        return types_pb2.DataType.Name(self.dtype)[3:].lower()


@dataclass(frozen=True)
class Skip:
    node: str
    reason: str


@dataclass
class Census:
    """What a scan of the graph found, before towers are considered."""

    sites: list[Site]
    inference: list[str]
    rewritten: list[str]
    skips: list[Skip]
    not_run: list[Skip] = field(default_factory=list)  # training sites no gradient step runs: not towers
    steps: dict[str, frozenset[str]] = field(default_factory=dict)  # training step -> the sites it runs
    copies: dict[str, dict[str, str]] = field(default_factory=dict)  # step run on copies (step_copies): node -> copy
