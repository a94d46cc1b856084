"""Writing a model in an output format: converting between formats, serialising, staging a
SavedModel directory (its variables and assets copied byte for byte)."""

from __future__ import annotations

import os
import shutil
from typing import Any

from google.protobuf import text_format

from bnrewrite.errors import BnRewriteError
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
from bnrewrite.io.staging import Outputs


def as_format(model: Model, fmt: str, chosen: list[Entry] | None = None) -> Model:
    """The model in output format `fmt` (which may need one graph picked with --tags)."""
    if fmt not in FORMATS:
        raise BnRewriteError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == model.format or (fmt == "savedmodel" and model.is_saved_model):
        return model
    if fmt == "savedmodel":
        raise BnRewriteError(
            f"cannot write a SavedModel from a {model.description}: a SavedModel needs variables; "
            "convert a SavedModel, or write --format pb/pbtxt/meta"
        )
    entries = model.entries
    if model.is_saved_model:
        wanted = {e.index for e in (chosen or entries)}
        entries = [e for e in entries if e.index in wanted]
        if len(entries) != 1:
            raise BnRewriteError(
                f"{shown(model.path)} has {len(entries)} MetaGraphs; pick one with --tags to write a {MESSAGE_NAMES[fmt]}"
            )
    entry = entries[0]
    if fmt in ("pb", "pbtxt"):
        return Model(model.path, fmt, [Entry(entry.graph_def)])
    meta = protos().MetaGraphDef()
    if entry.meta_graph is not None:
        meta.CopyFrom(entry.meta_graph)
    else:
        meta.graph_def.CopyFrom(entry.graph_def)
    return Model(model.path, fmt, [Entry(meta.graph_def, meta)])


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


def stage_model(outputs: Outputs, model: Model, path: str) -> list[str]:
    """Stage `model` to be written at `path` in its format; returns notes for the user."""
    notes: list[str] = []
    if not model.is_saved_model:
        outputs.stage_bytes(path, serialize(model))
        return notes

    def build(temp: str) -> None:
        source = model.path
        for name in sorted(os.listdir(source)):
            if name in (SAVED_MODEL_PB, SAVED_MODEL_PBTXT, FINGERPRINT):
                continue
            src, dst = os.path.join(source, name), os.path.join(temp, name)
            if os.path.isdir(src):
                shutil.copytree(src, dst, symlinks=True)
            else:
                shutil.copy2(src, dst, follow_symlinks=False)
        with open(os.path.join(temp, model.graph_file), "wb") as f:
            f.write(serialize(model))
        if os.path.exists(os.path.join(source, FINGERPRINT)):
            notes.append(_write_fingerprint(temp))

    outputs.stage_dir(path, build)
    return [n for n in notes if n]


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
