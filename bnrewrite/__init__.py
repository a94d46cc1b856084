"""bnrewrite: synchronized batch norm for replicated multi-tower TensorFlow graphs, as a rewrite."""

from bnrewrite.api import RewriteResult, rewrite_graph
from bnrewrite.errors import (
    AlreadyRewrittenError,
    BackendError,
    BnRewriteError,
    GraphValidationError,
    InferenceOnlyError,
    InputFormatError,
    NoBatchNormError,
    NoTowersError,
    OutputError,
    PassError,
    TowerMismatchError,
)

__version__ = "0.1.0"

__all__ = [
    "AlreadyRewrittenError",
    "BackendError",
    "BnRewriteError",
    "GraphValidationError",
    "InferenceOnlyError",
    "InputFormatError",
    "NoBatchNormError",
    "NoTowersError",
    "OutputError",
    "PassError",
    "RewriteResult",
    "TowerMismatchError",
    "rewrite_graph",
]
