"""The in-memory model: a GraphDef, MetaGraphDef or SavedModel file as a list of graphs."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any

from bnrewrite.errors import BnRewriteError
from bnrewrite.rewrite.report import Report

#: Output formats: GraphDef binary/text, MetaGraphDef binary/text, SavedModel directory.
FORMATS = ("pb", "pbtxt", "meta", "metatxt", "savedmodel")
DESCRIPTIONS = {
    "pb": "GraphDef (binary)",
    "pbtxt": "GraphDef (text)",
    "meta": "MetaGraphDef (binary)",
    "metatxt": "MetaGraphDef (text)",
    "savedmodel": "SavedModel",
}
#: The message type each format holds.
MESSAGE_NAMES = {
    "pb": "GraphDef", "pbtxt": "GraphDef", "meta": "MetaGraphDef", "metatxt": "MetaGraphDef",
    "savedmodel": "SavedModel",
}
SAVED_MODEL_PB = "saved_model.pb"
SAVED_MODEL_PBTXT = "saved_model.pbtxt"
FINGERPRINT = "fingerprint.pb"


@cache
def protos() -> SimpleNamespace:
    """TensorFlow's protobuf modules, imported on first use: importing them imports TensorFlow
    (seconds), which the path checks that run first do not need."""
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

    return SimpleNamespace(
        GraphDef=graph_pb2.GraphDef, MetaGraphDef=meta_graph_pb2.MetaGraphDef, SavedModel=saved_model_pb2.SavedModel
    )


@dataclass
class Entry:
    """One graph of a model: the whole of a GraphDef/MetaGraphDef file, or one tagged
    MetaGraph of a SavedModel (`tags` set, `index` its place in `meta_graphs`)."""

    graph_def: Any
    meta_graph: Any = None
    tags: tuple[str, ...] | None = None
    index: int = 0

    @property
    def label(self) -> str:
        return "" if self.tags is None else "[" + ",".join(self.tags) + "]"

    @property
    def message(self) -> Any:
        return self.meta_graph if self.meta_graph is not None else self.graph_def


@dataclass
class Model:
    path: str
    format: str
    entries: list[Entry]
    saved_model: Any = None
    #: SavedModel: the name of its graph file (saved_model.pb or saved_model.pbtxt).
    graph_file: str = SAVED_MODEL_PB

    @property
    def description(self) -> str:
        return DESCRIPTIONS[self.format]

    @property
    def is_saved_model(self) -> bool:
        return self.format == "savedmodel"


@dataclass
class Outcome:
    """What happened to one entry: rewritten (`report`), or kept as it was (`kept`: the
    error that says there is nothing to synchronize in it)."""

    entry: Entry
    report: Report | None = None
    kept: BnRewriteError | None = None
    result: Entry | None = None


@dataclass
class Rewrite:
    model: Model  # the rewritten model (entries not selected or kept are unchanged)
    outcomes: list[Outcome]


def shown(path: str) -> str:
    """A path as error messages show it (an empty one visibly)."""
    return path if path else "''"


def one_line(text: str, limit: int = 300) -> str:
    """`text` on one line, cut to `limit` characters: error messages are one line."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
