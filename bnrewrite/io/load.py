"""Reading a model from disk: the path checks that need no TensorFlow, then parsing and validation."""

from __future__ import annotations

import mmap
import os
import stat
from typing import Any

from bnrewrite.errors import GraphValidationError, InputFormatError
from bnrewrite.io.model import (
    MESSAGE_NAMES,
    SAVED_MODEL_PB,
    SAVED_MODEL_PBTXT,
    Entry,
    Model,
    shown,
)
from bnrewrite.io.sniff import HEAD_BYTES, check_binary, empty_error, parse_bytes, sniff_head


def check_input(path: str) -> None:
    """The checks on an input path that need no TensorFlow: the path, then the file's bytes
    (a walk over their top-level protobuf fields, through an mmap: nothing is read into memory)."""
    where = shown(path)
    if not os.path.lexists(path):
        raise InputFormatError(f"{where} does not exist; check the path")
    if not os.path.exists(path):
        raise InputFormatError(f"{where} is a broken symbolic link; check the path")
    if os.path.isdir(path):
        name = _saved_model_graph_file(path)
        _check_saved_model_contents(path)  # first: the graph file may be a link that leaves the model
        _check_file(os.path.join(path, name))
        return
    _check_file(path)


def _check_saved_model_contents(path: str) -> None:
    """What reading or copying a SavedModel would fail on, named as the input's problem: a
    symbolic link that leaves the model directory or leads nowhere (the graph file, variables/
    and what is inside it too: bnrewrite reads nothing outside the model), a FIFO, socket or
    device (reading one blocks or never ends), a file or folder that cannot be read."""
    def unreadable(error: OSError) -> None:
        raise InputFormatError(f"cannot read {shown(error.filename or path)} inside SavedModel {shown(path)}: "
                               f"{error.strerror or error}")

    real_root = os.path.realpath(path)
    for folder, dirs, files in os.walk(path, onerror=unreadable):  # links are listed, not followed
        for name in (*dirs, *files):
            entry = os.path.join(folder, name)
            info = os.lstat(entry)
            if stat.S_ISLNK(info.st_mode):
                inside_link(path, real_root, os.path.relpath(entry, path))
                continue
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                raise InputFormatError(
                    f"SavedModel {shown(path)} holds {os.path.relpath(entry, path)}, {_kind(info.st_mode)}, not a file "
                    "or folder; remove it from the model directory")
            if not os.access(entry, os.R_OK | (os.X_OK if stat.S_ISDIR(info.st_mode) else 0)):
                raise InputFormatError(f"cannot read {os.path.relpath(entry, path)} inside SavedModel {shown(path)}: "
                                       "permission denied")


def inside_link(root: str, real_root: str, rel: str) -> str:
    """The link `rel` of the model at `root` (`real_root` its real path) as a relative link that
    resolves in a copy. Raises InputFormatError when it leaves the model or leads nowhere."""
    full = os.path.join(root, rel)
    target = os.path.realpath(full)
    if target != real_root and not target.startswith(real_root.rstrip(os.sep) + os.sep):
        raise InputFormatError(
            f"SavedModel {shown(root)}: {shown(rel)} is a link to {shown(os.readlink(full))}, outside the model "
            "directory; bnrewrite reads only what is inside it: replace the link by what it points to"
        )
    if not os.path.exists(target):
        raise InputFormatError(f"SavedModel {shown(root)}: {shown(rel)} is a broken link (to {shown(os.readlink(full))}); "
                               "remove it or restore what it points to")
    # A walk enters no link, so the link's own directory is real_root/dirname(rel).
    return os.path.relpath(target, os.path.join(real_root, os.path.dirname(rel)))


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file"


def _check_file(path: str) -> None:
    where = shown(path)
    if not os.path.isfile(path):
        raise InputFormatError(f"{where} is not a regular file or a SavedModel directory")
    if not os.access(path, os.R_OK):
        raise InputFormatError(f"cannot read {where}: permission denied")
    if os.path.getsize(path) == 0:
        raise empty_error(where)
    sniff_head(_read(path, HEAD_BYTES), where)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            check_binary(data, where)
    except (OSError, ValueError) as exc:
        raise InputFormatError(f"cannot read {where}: {getattr(exc, 'strerror', None) or exc}") from None


def load(path: str) -> Model:
    """Read a model, telling its format from its content. Raises InputFormatError."""
    check_input(path)
    if os.path.isdir(path):
        return _load_saved_model(path)
    kind, message = parse_bytes(_read(path), shown(path))
    if kind == "savedmodel":
        directory = os.path.dirname(os.path.abspath(path)) or "."
        raise InputFormatError(
            f"{shown(path)} is the graph file of a SavedModel; pass its directory ({shown(directory)}) instead"
        )
    model = make_model(path, kind, message)
    validate(model)
    return model


def make_model(path: str, kind: str, message: Any) -> Model:
    """The model of a graph file of format `kind` holding `message` (a GraphDef or MetaGraphDef)."""
    if kind in ("pb", "pbtxt"):
        return Model(path, kind, [Entry(message)])
    return Model(path, kind, [Entry(message.graph_def, message)])


def validate(model: Model) -> None:
    """Every entry is a well-formed graph: unique names, inputs that resolve, no cycle."""
    from bnrewrite.graph.index import Graph

    for entry in model.entries:
        try:
            Graph.from_graph_def(entry.graph_def).validate()
        except GraphValidationError as exc:
            where = shown(model.path) + (f" MetaGraph {entry.label}" if entry.tags is not None else "")
            raise GraphValidationError(f"{where} is not a valid graph: {exc}; is the file truncated or edited?") from None


def _read(path: str, size: int = -1) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError as exc:
        raise InputFormatError(f"cannot read {shown(path)}: {exc.strerror or exc}") from None


def _saved_model_graph_file(path: str) -> str:
    """saved_model.pb or saved_model.pbtxt of the SavedModel directory `path`."""
    for name in (SAVED_MODEL_PB, SAVED_MODEL_PBTXT):
        graph_file = os.path.join(path, name)
        if os.path.isfile(graph_file) or os.path.islink(graph_file):  # a link: _check_saved_model_contents judges it
            return name
    raise InputFormatError(
        f"{shown(path)} is a directory but not a SavedModel (it has no {SAVED_MODEL_PB} or {SAVED_MODEL_PBTXT}); "
        "point bnrewrite at a SavedModel directory or a graph file"
    )


def _load_saved_model(path: str) -> Model:
    name = _saved_model_graph_file(path)
    graph_path = os.path.join(path, name)
    kind, message = parse_bytes(_read(graph_path), shown(graph_path))
    if kind != "savedmodel":
        raise InputFormatError(
            f"{shown(graph_path)} holds a {MESSAGE_NAMES[kind]}, not a SavedModel; re-export the SavedModel"
        )
    entries = [
        Entry(meta.graph_def, meta, tuple(meta.meta_info_def.tags), i) for i, meta in enumerate(message.meta_graphs)
    ]
    model = Model(path, "savedmodel", entries, saved_model=message, graph_file=name)
    validate(model)
    return model
