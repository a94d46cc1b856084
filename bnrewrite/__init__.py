"""bnrewrite: synchronized batch norm for replicated multi-tower TensorFlow graphs, as a rewrite.

`rewrite_graph`, `RewriteResult`, `check` and `enable`/`disable`/`enabled` are imported on first
use (PEP 562), so that
`import bnrewrite` and `bnrewrite --help` do not pay for importing TensorFlow, and the
command line can quiet TensorFlow's import-time logging before it happens.
"""

from bnrewrite.errors import (
    AlreadyRewrittenError,
    BackendError,
    BnRewriteError,
    ForeignGraphError,
    GraphValidationError,
    IndependentModelsError,
    InferenceOnlyError,
    InputFormatError,
    NoBatchNormError,
    NoTowersError,
    NotReplicasError,
    OutputError,
    PassError,
    RemovedByRewriteError,
    TowerMismatchError,
    UnsyncedLayerError,
)

__version__ = "0.1.0"

__all__ = [
    "AlreadyRewrittenError",
    "BackendError",
    "BnRewriteError",
    "ForeignGraphError",
    "GraphValidationError",
    "IndependentModelsError",
    "InferenceOnlyError",
    "InputFormatError",
    "NoBatchNormError",
    "NoTowersError",
    "NotReplicasError",
    "OutputError",
    "PassError",
    "RemovedByRewriteError",
    "RewriteResult",
    "TowerMismatchError",
    "UnsyncedLayerError",
    "check",
    "disable",
    "enable",
    "enabled",
    "rewrite_graph",
]

#: Public name -> the module defining it.
_LAZY = {
    "rewrite_graph": "bnrewrite.entry", "RewriteResult": "bnrewrite.rewrite.api", "check": "bnrewrite.rewrite.selfcheck",
    "enable": "bnrewrite.session.sessions", "disable": "bnrewrite.session.sessions", "enabled": "bnrewrite.session.sessions",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'bnrewrite' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
