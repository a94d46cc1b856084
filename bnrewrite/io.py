"""Models on disk: GraphDef (.pb, .pbtxt), MetaGraphDef (.meta) and SavedModel directories.

Protocol buffers are parsed and written only here. The format of an input is told from its
content, not its name: protobuf parses almost any bytes as *some* message, so a candidate
type is accepted only when every top-level field number and wire type belongs to it and the
parsed message holds a real graph (nodes with names and op types).

Writes are atomic and all-or-nothing: every output is first staged under a temporary name
in its target's directory (`Outputs.stage_*`), and only when all of them are complete are
they renamed into place (`Outputs.commit`). On any error the staged files are removed, so
a failed run leaves neither partial output nor a changed input.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from types import SimpleNamespace
from typing import Any

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf import text_format

from bnrewrite.errors import (
    BnRewriteError,
    GraphValidationError,
    InferenceOnlyError,
    InputFormatError,
    NoBatchNormError,
    OutputError,
    PassError,
)
from bnrewrite.report import Report


@cache
def _pb() -> SimpleNamespace:
    """TensorFlow's protobuf modules, imported on first use: importing them imports TensorFlow
    (seconds), which the path checks that run first do not need."""
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

    return SimpleNamespace(
        GraphDef=graph_pb2.GraphDef, MetaGraphDef=meta_graph_pb2.MetaGraphDef, SavedModel=saved_model_pb2.SavedModel
    )

#: Output formats: GraphDef binary/text, MetaGraphDef binary/text, SavedModel directory.
FORMATS = ("pb", "pbtxt", "meta", "metatxt", "savedmodel")
DESCRIPTIONS = {
    "pb": "GraphDef (binary)",
    "pbtxt": "GraphDef (text)",
    "meta": "MetaGraphDef (binary)",
    "metatxt": "MetaGraphDef (text)",
    "savedmodel": "SavedModel",
}
SAVED_MODEL_PB = "saved_model.pb"
SAVED_MODEL_PBTXT = "saved_model.pbtxt"
FINGERPRINT = "fingerprint.pb"

_OP_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_>]*$")
_MAGIC = (
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"GIF8", "a GIF image"),
    (b"%PDF", "a PDF document"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (a Keras .h5 model?)"),
    (b"PK\x03\x04", "a zip archive (a Keras .keras model?)"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"\x93NUMPY", "a NumPy array"),
    (b"\x7fELF", "an executable"),
    (b"\x80", "a Python pickle"),
)


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


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
    """What happened to one entry: rewritten (`report`), or kept as it was (`kept`, why)."""

    entry: Entry
    report: Report | None = None
    kept: str = ""
    result: Entry | None = None


@dataclass
class Rewrite:
    model: Model  # the rewritten model (entries not selected or kept are unchanged)
    outcomes: list[Outcome]


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def check_input(path: str) -> None:
    """The checks on an input path that need no parsing (and so no TensorFlow)."""
    shown = _shown(path)
    if not os.path.lexists(path):
        raise InputFormatError(f"{shown} does not exist; check the path")
    if not os.path.exists(path):
        raise InputFormatError(f"{shown} is a broken symbolic link; check the path")
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, n)) for n in (SAVED_MODEL_PB, SAVED_MODEL_PBTXT)):
            raise InputFormatError(
                f"{shown} is a directory but not a SavedModel (it has no {SAVED_MODEL_PB} or {SAVED_MODEL_PBTXT}); "
                "point bnrewrite at a SavedModel directory or a graph file"
            )
        return
    if not os.path.isfile(path):
        raise InputFormatError(f"{shown} is not a regular file or a SavedModel directory")
    if not os.access(path, os.R_OK):
        raise InputFormatError(f"cannot read {shown}: permission denied")
    if os.path.getsize(path) == 0:
        raise InputFormatError(f"{shown} is empty; point bnrewrite at a GraphDef, MetaGraphDef or SavedModel")
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as exc:
        raise InputFormatError(f"cannot read {shown}: {exc.strerror or exc}") from None
    _sniff(head, shown)


_TEXT_KEYS = re.compile(
    r"(^|\s)(node|versions|library|meta_graphs|saved_model_schema_version|meta_info_def|graph_def|"
    r"collection_def|signature_def|saver_def|asset_file_def|object_graph_def|version)\s*[:{<]"
)


def _sniff(head: bytes, shown: str) -> None:
    """Reject what is plainly not a model from its first bytes: known file signatures, blank
    files, and text that names none of the fields a text-format graph starts with."""
    if not head.strip():
        raise InputFormatError(f"{shown} is empty; point bnrewrite at a GraphDef, MetaGraphDef or SavedModel")
    for magic, what in _MAGIC[:-1]:  # a pickle's first byte is also a valid protobuf tag
        if head.startswith(magic):
            raise InputFormatError(f"{shown} is {what}, not a TensorFlow GraphDef, MetaGraphDef or SavedModel")
    text = _as_text(head[:-4] if len(head) == 1 << 16 else head, partial=len(head) == 1 << 16)
    if text is not None and not _TEXT_KEYS.search(text):
        if text.lstrip().startswith(("{", "[")):
            raise InputFormatError(
                f"{shown} is JSON (a Keras or TensorFlow.js model?), not a TensorFlow GraphDef, MetaGraphDef or SavedModel"
            )
        raise InputFormatError(f"{shown} is a text file but not a text-format GraphDef, MetaGraphDef or SavedModel")


def load(path: str) -> Model:
    """Read a model, telling its format from its content. Raises InputFormatError."""
    shown = _shown(path)
    check_input(path)
    if os.path.isdir(path):
        return _load_saved_model(path)
    data = _read(path)
    kind, message = parse_bytes(data, shown)
    if kind == "savedmodel":
        directory = os.path.dirname(os.path.abspath(path)) or "."
        raise InputFormatError(
            f"{shown} is the graph file of a SavedModel; pass its directory ({_shown(directory)}) instead"
        )
    model = _model(path, kind, message)
    validate(model)
    return model


def parse_bytes(data: bytes, shown: str = "input") -> tuple[str, Any]:
    """(format, message) for the bytes of a GraphDef, MetaGraphDef or SavedModel file.

    format is "pb", "meta" or "savedmodel" for binary files, "pbtxt"/"metatxt"/"savedmodel"
    (with a text SavedModel) for text. Raises InputFormatError saying what the bytes are.
    """
    if not data.strip():
        raise InputFormatError(f"{shown} is empty; point bnrewrite at a GraphDef, MetaGraphDef or SavedModel")
    binary_problem = decode_error = ""
    fields, wire_error = _wire_fields(data)
    if wire_error is None:
        for kind, cls, good in _candidates():
            if not _fits(fields, cls.DESCRIPTOR):
                continue
            message = cls()
            try:
                message.ParseFromString(data)
            except (_message.DecodeError, RuntimeError, ValueError) as exc:
                decode_error = decode_error or f"it does not decode as a {_NAMES[kind]} ({_one_line(str(exc), 120)})"
                continue
            problem = good(message)
            if problem is None:
                return kind, message
            binary_problem = binary_problem or f"it parses as a {_NAMES[kind]} but {problem}"
    text = _as_text(data)
    if text is not None:
        return _parse_text(text, shown)
    for magic, what in _MAGIC:
        if data.startswith(magic):
            raise InputFormatError(
                f"{shown} is {what}, not a TensorFlow GraphDef, MetaGraphDef or SavedModel"
            )
    if wire_error == "truncated":
        raise InputFormatError(
            f"{shown} is truncated or corrupt: a protobuf field runs past the end of the file "
            f"({len(data)} bytes); re-export the model"
        )
    detail = binary_problem or decode_error or (
        f"not a valid protobuf ({wire_error})" if wire_error else "its fields match none of these message types"
    )
    raise InputFormatError(
        f"{shown} is corrupt or not a GraphDef, MetaGraphDef or SavedModel: {detail}; re-export the model or check the path"
    )


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InputFormatError(f"cannot read {_shown(path)}: {exc.strerror or exc}") from None


def _load_saved_model(path: str) -> Model:
    shown = _shown(path)
    for name in (SAVED_MODEL_PB, SAVED_MODEL_PBTXT):
        graph_path = os.path.join(path, name)
        if os.path.isfile(graph_path):
            break
    else:
        raise InputFormatError(
            f"{shown} is a directory but not a SavedModel (it has no {SAVED_MODEL_PB} or {SAVED_MODEL_PBTXT}); "
            "point bnrewrite at a SavedModel directory or a graph file"
        )
    data = _read(graph_path)
    kind, message = parse_bytes(data, _shown(graph_path))
    if kind != "savedmodel":
        raise InputFormatError(
            f"{_shown(graph_path)} holds a {_NAMES[kind]}, not a SavedModel; re-export the SavedModel"
        )
    entries = [
        Entry(meta.graph_def, meta, tuple(meta.meta_info_def.tags), i) for i, meta in enumerate(message.meta_graphs)
    ]
    model = Model(path, "savedmodel", entries, saved_model=message, graph_file=name)
    validate(model)
    return model


def _model(path: str, kind: str, message: Any) -> Model:
    if kind in ("pb", "pbtxt"):
        return Model(path, kind, [Entry(message)])
    return Model(path, kind, [Entry(message.graph_def, message)])


def validate(model: Model) -> None:
    """Every entry is a well-formed graph: unique names, inputs that resolve, no cycle."""
    from bnrewrite.graph import Graph

    for entry in model.entries:
        try:
            Graph.from_graph_def(entry.graph_def).validate()
        except GraphValidationError as exc:
            where = f"{_shown(model.path)}" + (f" MetaGraph {entry.label}" if entry.tags is not None else "")
            raise GraphValidationError(f"{where} is not a valid graph: {exc}; is the file truncated or edited?") from None


_NAMES = {
    "pb": "GraphDef", "pbtxt": "GraphDef", "meta": "MetaGraphDef", "metatxt": "MetaGraphDef",
    "savedmodel": "SavedModel",
}


def _graph_problem(graph_def: Any) -> str | None:
    if not graph_def.node:
        return "it has no nodes"
    for node in graph_def.node:
        if not node.name:
            return "a node has no name"
        if not _OP_RE.match(node.op):
            return f"node {node.name[:60]!r} has no valid op type"
    return None


def _meta_problem(meta: Any) -> str | None:
    if not meta.HasField("graph_def"):
        return "it holds no graph_def"
    return _graph_problem(meta.graph_def)


def _saved_model_problem(saved: Any) -> str | None:
    if not saved.meta_graphs:
        return "it holds no MetaGraph"
    for i, meta in enumerate(saved.meta_graphs):
        problem = _meta_problem(meta)
        if problem:
            return f"its MetaGraph {i} {problem.removeprefix('it ')}"
    return None


def _candidates() -> tuple[tuple[str, type, Callable[[Any], str | None]], ...]:
    pb = _pb()
    return (
        ("savedmodel", pb.SavedModel, _saved_model_problem),
        ("meta", pb.MetaGraphDef, _meta_problem),
        ("pb", pb.GraphDef, _graph_problem),
    )


def _text_candidates() -> tuple[tuple[str, type, Callable[[Any], str | None], tuple[str, ...]], ...]:
    pb = _pb()
    return (
        ("savedmodel", pb.SavedModel, _saved_model_problem, ("meta_graphs", "saved_model_schema_version")),
        ("metatxt", pb.MetaGraphDef, _meta_problem, ("meta_info_def", "graph_def", "collection_def", "signature_def")),
        ("pbtxt", pb.GraphDef, _graph_problem, ("node", "versions", "library")),
    )


def _wire_fields(data: bytes) -> tuple[dict[int, set[int]], str | None]:
    """Top-level fields of serialized protobuf bytes as {number: wire types}, and what is
    wrong with the bytes as a protobuf ("truncated", ...) or None."""
    fields: dict[int, set[int]] = {}
    pos, end = 0, len(data)
    try:
        while pos < end:
            tag, pos = _varint(data, pos)
            number, wire = tag >> 3, tag & 7
            if number == 0:
                return fields, "field number 0"
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire == 1:
                pos += 8
            elif wire == 2:
                length, pos = _varint(data, pos)
                pos += length
            elif wire == 5:
                pos += 4
            else:
                return fields, f"unsupported wire type {wire}"
            if pos > end:
                return fields, "truncated"
            fields.setdefault(number, set()).add(wire)
    except IndexError:
        return fields, "truncated"
    except ValueError as exc:
        return fields, str(exc)
    return fields, None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise ValueError("malformed varint")


_VARINT_TYPES = {
    _descriptor.FieldDescriptor.TYPE_INT32, _descriptor.FieldDescriptor.TYPE_INT64,
    _descriptor.FieldDescriptor.TYPE_UINT32, _descriptor.FieldDescriptor.TYPE_UINT64,
    _descriptor.FieldDescriptor.TYPE_SINT32, _descriptor.FieldDescriptor.TYPE_SINT64,
    _descriptor.FieldDescriptor.TYPE_BOOL, _descriptor.FieldDescriptor.TYPE_ENUM,
}
_FIXED64 = {_descriptor.FieldDescriptor.TYPE_FIXED64, _descriptor.FieldDescriptor.TYPE_SFIXED64, _descriptor.FieldDescriptor.TYPE_DOUBLE}
_FIXED32 = {_descriptor.FieldDescriptor.TYPE_FIXED32, _descriptor.FieldDescriptor.TYPE_SFIXED32, _descriptor.FieldDescriptor.TYPE_FLOAT}


def _wire_types(field_descriptor: Any) -> set[int]:
    kind = field_descriptor.type
    if kind in _VARINT_TYPES:
        wires = {0}
    elif kind in _FIXED64:
        wires = {1}
    elif kind in _FIXED32:
        wires = {5}
    else:
        return {2}
    repeated = getattr(field_descriptor, "is_repeated", None)
    if repeated is None:  # protobuf < 5.28
        repeated = field_descriptor.label == _descriptor.FieldDescriptor.LABEL_REPEATED
    if repeated:
        wires.add(2)  # packed
    return wires


def _fits(fields: dict[int, set[int]], descriptor: Any) -> bool:
    """Every top-level field is one the message type declares, with a wire type it allows."""
    if not fields:
        return False
    by_number = descriptor.fields_by_number
    return all(n in by_number and wires <= _wire_types(by_number[n]) for n, wires in fields.items())


def _as_text(data: bytes, partial: bool = False) -> str | None:
    try:
        text = data.decode("utf-8", "ignore" if partial else "strict")
    except UnicodeDecodeError:
        return None
    printable = sum(ch.isprintable() or ch in "\t\r\n" for ch in text[:4096])
    return text if printable >= 0.95 * min(len(text), 4096) else None


def _parse_text(text: str, shown: str) -> tuple[str, Any]:
    errors: list[tuple[int, str, str]] = []
    for kind, cls, good, keys in _text_candidates():
        message = cls()
        try:
            text_format.Parse(text, message, allow_unknown_extension=False)
        except text_format.ParseError as exc:
            hits = sum(re.search(rf"(^|\s){k}\s*[:{{]", text) is not None for k in keys)
            errors.append((hits, _NAMES[kind], str(exc)))
            continue
        except (RecursionError, ValueError) as exc:
            errors.append((0, _NAMES[kind], str(exc)))
            continue
        problem = good(message)
        if problem is None:
            return kind, message
        errors.append((10, _NAMES[kind], problem))
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):
        raise InputFormatError(
            f"{shown} is JSON (a Keras or TensorFlow.js model?), not a TensorFlow GraphDef, MetaGraphDef or SavedModel"
        )
    hits, name, error = max(errors, key=lambda e: e[0])
    if hits == 0:
        raise InputFormatError(f"{shown} is a text file but not a text-format GraphDef, MetaGraphDef or SavedModel")
    raise InputFormatError(f"{shown} is not a valid text-format {name} ({_one_line(error)}); is it truncated or edited?")


# ---------------------------------------------------------------------------
# Rewriting
# ---------------------------------------------------------------------------


def parse_tags(specs: Sequence[str] | None) -> list[frozenset[str]] | None:
    """--tags values ("serve", "train,gpu"; several allowed) as tag sets; None selects all."""
    if not specs:
        return None
    sets = []
    for spec in specs:
        for group in spec.split(";"):
            tags = frozenset(t.strip() for t in group.split(",") if t.strip())
            if not tags:
                raise BnRewriteError(f"--tags {spec!r} names no tag; write e.g. --tags train or --tags serve,gpu")
            sets.append(tags)
    return sets


def select(model: Model, tag_sets: list[frozenset[str]] | None) -> list[Entry]:
    """The entries `tag_sets` names (all when None). Raises InputFormatError for a missing tag set."""
    if tag_sets is None:
        return list(model.entries)
    if not model.is_saved_model:
        raise BnRewriteError(f"--tags applies to SavedModels; {_shown(model.path)} is a {model.description}")
    chosen = []
    for tags in tag_sets:
        found = [e for e in model.entries if frozenset(e.tags or ()) == tags]
        if not found:
            have = ", ".join(e.label for e in model.entries) or "none"
            raise InputFormatError(
                f"{_shown(model.path)} has no MetaGraph tagged [{','.join(sorted(tags))}] (it has {have}); "
                "pick one of those with --tags"
            )
        chosen.extend(e for e in found if e not in chosen)
    return chosen


#: Errors that, when rewriting every MetaGraph of a SavedModel, only mean "nothing to do here".
_NOTHING_TO_DO = (InferenceOnlyError, NoBatchNormError)


def rewrite(model: Model, tag_sets: list[frozenset[str]] | None = None, *, keep_idle: bool | None = None,
            **options: Any) -> Rewrite:
    """Rewrite the selected entries of `model` with `bnrewrite.rewrite_graph(**options)`.

    Entries with nothing to synchronize (inference only, no batch norm) are kept unchanged
    when `keep_idle`; by default that is when every MetaGraph of a SavedModel is rewritten
    (no tag sets given), and then if none is left, the first one's error is raised.
    Every rewritten MetaGraph's signatures and saver must still name tensors that exist.
    """
    from bnrewrite.api import rewrite_graph

    default = keep_idle is None
    if default:
        keep_idle = model.is_saved_model and tag_sets is None and len(model.entries) > 1
    chosen = select(model, tag_sets)
    outcomes: list[Outcome] = []
    first_skip: BnRewriteError | None = None
    for entry in chosen:
        try:
            result = rewrite_graph(entry.message, **options)
        except _NOTHING_TO_DO as exc:
            if not keep_idle:
                raise _located(exc, model, entry) from None
            first_skip = first_skip or _located(exc, model, entry)
            outcomes.append(Outcome(entry, kept=str(exc)))
            continue
        except BnRewriteError as exc:
            raise _located(exc, model, entry) from None
        new = Entry(result.graph_def, result.meta_graph_def, entry.tags, entry.index)
        if new.meta_graph is not None:
            _check_references(entry.meta_graph, new.meta_graph, model, entry, result.report)
        outcomes.append(Outcome(entry, report=result.report, result=new))
    if default and not any(o.report for o in outcomes) and first_skip is not None:
        raise first_skip
    return Rewrite(_replace_entries(model, [o.result for o in outcomes if o.result]), outcomes)


def _located(exc: BnRewriteError, model: Model, entry: Entry) -> BnRewriteError:
    """The same error, its message prefixed with the MetaGraph it is about."""
    if entry.tags is None:
        return exc
    return type(exc)(f"MetaGraph {entry.label} of {_shown(model.path)}: {exc}")


def _replace_entries(model: Model, new: list[Entry]) -> Model:
    by_index = {e.index: e for e in new}
    entries = [by_index.get(e.index, e) for e in model.entries]
    saved = None
    if model.saved_model is not None:
        saved = _pb().SavedModel()
        saved.CopyFrom(model.saved_model)
        for e in new:
            saved.meta_graphs[e.index].CopyFrom(e.meta_graph)
        entries = [Entry(m.graph_def, m, tuple(m.meta_info_def.tags), i) for i, m in enumerate(saved.meta_graphs)]
    return Model(model.path, model.format, entries, saved, model.graph_file)


def meta_references(meta: Any) -> list[tuple[str, str]]:
    """(what, node name) for every node that the MetaGraph's signatures and saver name."""
    from bnrewrite.graph import parse_input

    refs: list[tuple[str, str]] = []
    for sig_name, sig in meta.signature_def.items():
        for kind, tensors in (("input", sig.inputs), ("output", sig.outputs)):
            for key, info in tensors.items():
                for tensor in _tensor_info_names(info):
                    refs.append((f"signature {sig_name!r} {kind} {key!r} ({tensor})", parse_input(tensor)[0]))
    saver = meta.saver_def
    for attr in ("filename_tensor_name", "save_tensor_name", "restore_op_name"):
        value = getattr(saver, attr)
        if value:
            refs.append((f"saver {attr} ({value})", parse_input(value)[0]))
    return refs


def _tensor_info_names(info: Any) -> list[str]:
    kind = info.WhichOneof("encoding")
    if kind == "name":
        return [info.name]
    if kind == "coo_sparse":
        c = info.coo_sparse
        return [n for n in (c.values_tensor_name, c.indices_tensor_name, c.dense_shape_tensor_name) if n]
    if kind == "composite_tensor":
        return [n for component in info.composite_tensor.components for n in _tensor_info_names(component)]
    return []


def _check_references(before: Any, after: Any, model: Model, entry: Entry, report: Report) -> None:
    have_before = {n.name for n in before.graph_def.node}
    have_after = {n.name for n in after.graph_def.node}
    refs = [(what, node) for what, node in meta_references(before) if node in have_before]
    lost = [(what, node) for what, node in refs if node not in have_after]
    if lost:
        what, node = lost[0]
        raise GraphValidationError(
            f"{'MetaGraph ' + entry.label + ' of ' if entry.tags is not None else ''}{_shown(model.path)}: "
            f"the rewrite removed {node}, which {what} names; remove it from the signature and export again"
        )
    if after.signature_def:
        report.notes.append(
            f"{len(after.signature_def)} signature(s) checked: all {sum(1 for w, _ in refs if w.startswith('signature'))} tensors still resolve"
        )


# ---------------------------------------------------------------------------
# Output formats
# ---------------------------------------------------------------------------


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
                f"{_shown(model.path)} has {len(entries)} MetaGraphs; pick one with --tags to write a {_NAMES[fmt]}"
            )
    entry = entries[0]
    if fmt in ("pb", "pbtxt"):
        return Model(model.path, fmt, [Entry(entry.graph_def)])
    meta = _pb().MetaGraphDef()
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


# ---------------------------------------------------------------------------
# Writing: stage everything, then rename into place
# ---------------------------------------------------------------------------


def same_or_nested(a: str, b: str) -> bool:
    """Whether paths a and b are the same, or one lies inside the other."""
    ra, rb = os.path.realpath(a), os.path.realpath(b)
    if ra == rb:
        return True
    try:
        if os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b):
            return True
    except OSError:
        pass
    return ra.startswith(rb.rstrip(os.sep) + os.sep) or rb.startswith(ra.rstrip(os.sep) + os.sep)


def check_output(path: str, inputs: Iterable[str], force: bool, what: str = "output") -> None:
    """Raise OutputError when `path` cannot or must not be written."""
    shown = _shown(path)
    for source in inputs:
        if same_or_nested(path, source):
            relation = "is" if os.path.realpath(path) == os.path.realpath(source) else "overlaps"
            raise OutputError(
                f"{what} {shown} {relation} the input {_shown(source)}; write to a new path (bnrewrite never overwrites its input)"
            )
    if os.path.lexists(path) and not force:
        raise OutputError(f"{what} {shown} already exists; pass --force to overwrite it, or choose a new path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        problem = "is not a directory" if os.path.lexists(parent) else "does not exist"
        raise OutputError(f"cannot write {shown}: {_shown(parent)} {problem}; create the directory first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {shown}: directory {_shown(parent)} is not writable")


@dataclass
class _Staged:
    temp: str
    final: str


@dataclass
class Outputs:
    """Outputs staged under temporary names beside their targets; `commit` renames them in."""

    staged: list[_Staged] = field(default_factory=list)
    #: Directories made for outputs (outermost first), removed again on rollback if still empty.
    made: list[str] = field(default_factory=list)

    def make_dir(self, path: str) -> None:
        """Make `path` and its missing parents now; rollback removes them again."""
        missing = []
        probe = os.path.abspath(path)
        while not os.path.exists(probe):
            missing.append(probe)
            probe = os.path.dirname(probe)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot make directory {_shown(path)}: {exc.strerror or exc}") from None
        self.made.extend(reversed(missing))

    def stage_bytes(self, path: str, data: bytes) -> None:
        parent = os.path.dirname(os.path.abspath(path))
        temp = self._temp(path, lambda: tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent))
        try:
            with open(temp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(temp, 0o666 & ~_umask())
        except OSError as exc:
            raise OutputError(f"cannot write {_shown(path)}: {exc.strerror or exc}") from None

    def stage_dir(self, path: str, build: Callable[[str], None]) -> None:
        """`build(temp_dir)` fills a fresh directory that becomes `path` on commit."""
        parent = os.path.dirname(os.path.abspath(path))
        temp = self._temp(path, lambda: (None, tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)))
        try:
            build(temp)
            os.chmod(temp, 0o777 & ~_umask())
        except OSError as exc:
            raise OutputError(f"cannot write {_shown(path)}: {exc.strerror or exc}") from None

    def _temp(self, path: str, make: Callable[[], tuple[Any, str]]) -> str:
        try:
            handle, temp = make()
        except OSError as exc:
            raise OutputError(f"cannot write {_shown(path)}: {exc.strerror or exc}") from None
        if isinstance(handle, int):
            os.close(handle)
        self.staged.append(_Staged(temp, path))
        return temp

    def commit(self) -> None:
        """Rename every staged output into place (replacing what is there)."""
        for item in self.staged:
            try:
                _replace(item.temp, item.final)
            except OSError as exc:
                self.rollback()
                raise OutputError(f"cannot write {_shown(item.final)}: {exc.strerror or exc}") from None
        self.staged.clear()
        self.made.clear()

    def rollback(self) -> None:
        for item in self.staged:
            _remove(item.temp)
        self.staged.clear()
        for directory in reversed(self.made):
            try:
                os.rmdir(directory)
            except OSError:
                pass
        self.made.clear()

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.rollback()


def _replace(temp: str, final: str) -> None:
    """os.replace, also when a directory is replaced or replaces (the old one moved aside first)."""
    if os.path.isdir(final) and not os.path.islink(final) or os.path.isdir(temp) and os.path.lexists(final):
        aside = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.old.", dir=os.path.dirname(os.path.abspath(final)))
        old = os.path.join(aside, "old")
        os.rename(final, old)
        try:
            os.rename(temp, final)
        except OSError:
            os.rename(old, final)
            raise
        finally:
            _remove(aside)
        return
    os.replace(temp, final)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError:
            pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
        return f"fingerprint.pb not written ({_one_line(str(exc))}); TensorFlow loads the SavedModel without it"
    with open(os.path.join(directory, FINGERPRINT), "wb") as f:
        f.write(data)
    return ""


# ---------------------------------------------------------------------------
# Verification (imports, never runs)
# ---------------------------------------------------------------------------


def import_check(entry: Entry) -> str | None:
    """Import the entry into a fresh tf.Graph (a MetaGraph with its collections); the error or None."""
    import tensorflow as tf

    try:
        with tf.Graph().as_default():
            if entry.meta_graph is not None:
                tf.compat.v1.train.import_meta_graph(entry.meta_graph, clear_devices=False)
            else:
                tf.compat.v1.import_graph_def(entry.graph_def, name="")
    except Exception as exc:  # noqa: BLE001 - TensorFlow raises many kinds; all mean "does not import"
        return _one_line(str(exc)) or type(exc).__name__
    return None


def verify(rewrite: Rewrite) -> int:
    """Import every rewritten graph into TensorFlow. Raises PassError when one does not import
    (or InputFormatError when the input graph itself does not). Returns how many were checked."""
    checked = 0
    for outcome in rewrite.outcomes:
        if outcome.result is None:
            continue
        error = import_check(outcome.result)
        if error is not None:
            where = f"MetaGraph {outcome.entry.label}: " if outcome.entry.tags is not None else ""
            if import_check(outcome.entry) is not None:
                raise InputFormatError(
                    f"{where}the input graph itself does not import into TensorFlow ({error}); fix or re-export it"
                )
            raise PassError(f"{where}the rewritten graph does not import into TensorFlow ({error}); nothing was written (a bnrewrite bug: please report it)")
        checked += 1
    return checked


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def op_counts(graph_def: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in graph_def.node:
        counts[node.op] = counts.get(node.op, 0) + 1
    return counts


def _shown(path: str) -> str:
    return path if path else "''"


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
