"""Writing a model in an output format: converting between formats, serialising, staging a
SavedModel directory (its variables and assets copied byte for byte)."""

from __future__ import annotations

import os
import shutil
import stat
from typing import Any

from google.protobuf import text_format

from bnrewrite.errors import BnRewriteError, InputFormatError
from bnrewrite.io.load import inside_link
from bnrewrite.io.model import (
    FINGERPRINT,
    FORMATS,
    MESSAGE_NAMES,
    SAVED_MODEL_PB,
    SAVED_MODEL_PBTXT,
    Entry,
    Model,
    one_line,
    protos,
    shown,
)
from bnrewrite.io.staging import SAVED_MODEL, Outputs, describe

#: Bytes read at a time when copying a SavedModel's files.
_CHUNK = 1 << 20


def as_format(model: Model, fmt: str, chosen: list[Entry] | None = None) -> Model:
    """The model in output format `fmt`; from a SavedModel, a single-graph format takes the one
    graph `chosen` (the entries --tags selected; all when None)."""
    entries = output_entries(model, fmt, chosen)
    if entries is None:
        return model
    entry = entries[0]
    if fmt in ("pb", "pbtxt"):
        return Model(model.path, fmt, [Entry(entry.graph_def)])
    meta = protos().MetaGraphDef()
    if entry.meta_graph is not None:
        meta.CopyFrom(entry.meta_graph)
    else:
        meta.graph_def.CopyFrom(entry.graph_def)
    return Model(model.path, fmt, [Entry(meta.graph_def, meta)])


def output_entries(model: Model, fmt: str, chosen: list[Entry] | None = None) -> list[Entry] | None:
    """The one entry written in single-graph format `fmt` (None: the model is written as it is).
    Raises BnRewriteError when `fmt` cannot hold the model or `chosen` is not one graph."""
    if fmt not in FORMATS:
        raise BnRewriteError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == model.format or (fmt == "savedmodel" and model.is_saved_model):
        return None
    if fmt == "savedmodel":
        raise BnRewriteError(
            f"cannot write a SavedModel from a {model.description}: a SavedModel needs variables; "
            "convert a SavedModel, or write --format pb/pbtxt/meta"
        )
    if not model.is_saved_model:
        return model.entries
    wanted = {e.index for e in (model.entries if chosen is None else chosen)}
    entries = [e for e in model.entries if e.index in wanted]
    if len(entries) != 1:
        labels = ", ".join(e.label for e in entries)
        raise BnRewriteError(
            f"{shown(model.path)}: --format {fmt} writes one {MESSAGE_NAMES[fmt]}, but {len(entries)} MetaGraphs "
            f"are selected ({labels}); pick one with --tags (e.g. --tags {','.join(entries[0].tags or ()) if entries else 'train'})"
        )
    return entries


def serialize(model: Model) -> bytes:
    """The bytes of a single-file model (pb, pbtxt, meta, metatxt) or of a SavedModel's graph file."""
    if model.is_saved_model:
        message: Any = model.saved_model
        text = model.graph_file == SAVED_MODEL_PBTXT
    else:
        message = model.entries[0].message
        text = model.format in ("pbtxt", "metatxt")
    if text:
        return text_format.MessageToString(message).encode("utf-8")
    return message.SerializeToString(deterministic=True)


def stage_model(outputs: Outputs, model: Model, path: str, what: str = "OUT") -> list[str]:
    """Stage `model` to be written at `path` in its format; returns notes for the user."""
    notes: list[str] = []
    if not model.is_saved_model:
        outputs.stage_bytes(path, serialize(model), what)
        return notes
    tree = model_tree(model.path)

    def build(temp: str) -> None:
        _copy_tree(model.path, tree, temp)
        with open(os.path.join(temp, model.graph_file), "wb") as f:
            f.write(serialize(model))
        if os.path.exists(os.path.join(model.path, FINGERPRINT)):
            notes.append(_write_fingerprint(temp))

    outputs.stage_dir(path, build, SAVED_MODEL, what)
    return [n for n in notes if n]


def model_tree(root: str) -> list[tuple[str, str, str]]:
    """What a SavedModel copy holds besides its graph files: (relative path, kind, link text)
    with kind "dir", "file" or "link", parents before children.

    A link is kept only when it resolves inside the model directory, and becomes a relative
    link (so it resolves in the copy); one that leaves the model, or resolves to nothing, is
    refused, as are FIFOs, devices and sockets: the copy never reads outside the model.
    Raises InputFormatError naming them."""
    real_root = os.path.realpath(root)
    entries: list[tuple[str, str, str]] = []
    pending = [""]
    while pending:
        relative = pending.pop()
        try:
            names = sorted(os.listdir(os.path.join(root, relative)))
        except OSError as exc:
            raise InputFormatError(f"cannot read {shown(os.path.join(root, relative))}: {exc.strerror or exc}") from None
        for name in names:
            rel = os.path.join(relative, name)
            if not relative and name in (SAVED_MODEL_PB, SAVED_MODEL_PBTXT, FINGERPRINT):
                continue
            full = os.path.join(root, rel)
            try:
                mode = os.lstat(full).st_mode
            except OSError as exc:
                raise InputFormatError(f"cannot read {shown(full)}: {exc.strerror or exc}") from None
            if stat.S_ISLNK(mode):
                entries.append((rel, "link", inside_link(root, real_root, rel)))
            elif stat.S_ISDIR(mode):
                entries.append((rel, "dir", ""))
                pending.append(rel)
            elif stat.S_ISREG(mode):
                entries.append((rel, "file", ""))
            else:
                raise InputFormatError(
                    f"SavedModel {shown(root)} holds {shown(rel)}, {describe(full)}; a SavedModel holds only files, "
                    "directories and links inside it: remove it or export the model again"
                )
    entries.sort(key=lambda e: e[0].split(os.sep))
    return entries


def _copy_tree(root: str, tree: list[tuple[str, str, str]], target: str) -> None:
    """Copy the `model_tree` of `root` into the directory `target`, file contents, modes and
    times alike: reading errors are the input's (InputFormatError), writing errors raise OSError."""
    for rel, kind, link in tree:
        src, dst = os.path.join(root, rel), os.path.join(target, rel)
        if kind == "dir":
            os.mkdir(dst)
        elif kind == "link":
            os.symlink(link, dst)
        else:
            _copy_file(src, dst)
    for rel, kind, _ in reversed(tree):
        if kind == "dir":
            shutil.copystat(os.path.join(root, rel), os.path.join(target, rel))


def _copy_file(src: str, dst: str) -> None:
    try:
        source = open(src, "rb")
    except OSError as exc:
        raise InputFormatError(f"cannot read {shown(src)}: {exc.strerror or exc}") from None
    with source, open(dst, "wb") as out:
        while True:
            try:
                chunk = source.read(_CHUNK)
            except OSError as exc:
                raise InputFormatError(f"cannot read {shown(src)}: {exc.strerror or exc}") from None
            if not chunk:
                break
            out.write(chunk)
    shutil.copystat(src, dst)


def _write_fingerprint(directory: str) -> str:
    """A fingerprint.pb for the new graph (the input's would no longer match it)."""
    try:
        from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting

        data = fingerprinting.CreateFingerprintDef(directory)
    except Exception as exc:  # noqa: BLE001 - an optional file; say why it is missing
        return f"fingerprint.pb not written ({one_line(str(exc))}); TensorFlow loads the SavedModel without it"
    with open(os.path.join(directory, FINGERPRINT), "wb") as f:
        f.write(data)
    return ""
