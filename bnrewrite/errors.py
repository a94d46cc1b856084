"""Exceptions for a user's mistakes: each carries one line saying what is wrong and what to do.

Every class has its own CLI exit code, so scripts can tell the failures apart.
"""

from __future__ import annotations


class BnRewriteError(Exception):
    """Base class; `exit_code` is what the command line returns for it."""

    exit_code = 1


class InputFormatError(BnRewriteError):
    """The file is not a GraphDef, MetaGraphDef or SavedModel, or it is truncated or corrupt.

    Also: zero bytes, a checkpoint's .index or .data file, a SavedModel that holds a FIFO,
    device or unreadable file."""

    exit_code = 3


class NoBatchNormError(BnRewriteError):
    """The graph has no batch-norm op at all."""

    exit_code = 4


class InferenceOnlyError(BnRewriteError):
    """Every batch-norm op is in inference mode: there is nothing to synchronize."""

    exit_code = 5


class NoTowersError(BnRewriteError):
    """Fewer than two towers, or towers that train independent models."""

    exit_code = 6


class IndependentModelsError(NoTowersError):
    """The towers train independent models: synchronizing them would couple K trainings.

    A NoTowersError (same exit code) that `bnrewrite run` refuses, where a graph with one
    tower runs unchanged."""


class NotReplicasError(NoTowersError):
    """What looked like towers are not data-parallel replicas: layers of one model, chained or
    separate networks, or one network applied twice inside one gradient computation.

    A NoTowersError (same exit code): `bnrewrite run` and `enable()` run such graphs unchanged."""


class TowerMismatchError(BnRewriteError):
    """Towers were found but no batch-norm layer lines up across all of them."""

    exit_code = 7


class UnsyncedLayerError(TowerMismatchError):
    """A training batch-norm layer of a multi-tower graph cannot be synchronized (it does not
    line up, or sits where the rewrite cannot reach): the towers would not train like one
    device, so the graph is refused as a whole unless allow_unsynced / --allow-unsynced.

    A TowerMismatchError (same exit code, 7): some layer does not line up across the towers.
    `--verify` and `bnrewrite verify` raise it too for a layer left unsynchronized (with
    allow_unsynced), after checking the synchronized ones."""


class AlreadyRewrittenError(BnRewriteError):
    """The graph already carries bnrewrite's synchronized batch norm."""

    exit_code = 8


class BackendError(BnRewriteError):
    """The chosen collective backend cannot serve these towers' devices."""

    exit_code = 9


class OutputError(BnRewriteError):
    """An output path is unusable: it exists, holds what bnrewrite does not replace, is the input, or cannot be written."""

    exit_code = 10


class GraphValidationError(BnRewriteError):
    """A graph is malformed: dangling inputs, duplicate names, a cycle, bad attrs or devices.

    Also: an input naming an output its node does not have (x:999), a batch-norm attr of the
    wrong kind or dtype, a device whose task or replica is not a number."""

    exit_code = 11


class PassError(GraphValidationError):
    """A rewrite pass produced an invalid graph; names the pass. A bug in bnrewrite."""

    exit_code = 12


class StepTimeoutError(BnRewriteError):
    """Under `bnrewrite run` / `enable()`, a synchronized step's all-reduce did not complete within
    its bound: a tower that does not run its member, a worker that died, never started, or was
    given the same task index as another. Names the layer, the towers and the bound."""

    exit_code = 13


class RemovedByRewriteError(BnRewriteError):
    """A handle names a node the rewrite removed (e.g. a duplicate moving-average update)."""


class ForeignGraphError(BnRewriteError):
    """`RewriteResult.find` was given a graph its `to_graph()` did not build (e.g. the input graph)."""

