"""Telling a model's format from its content, not its name.

Protobuf parses almost any bytes as *some* message, so a candidate type is accepted only when
protobuf keeps no unknown top-level field after parsing the bytes as it (every field number
and wire type belongs to the type) and the message holds a real graph (nodes with names and
op types). Bytes that are not protobuf wire format at all, and files plainly something else
(images, archives, JSON, prose), are named as what they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from google.protobuf import descriptor as _descriptor
from google.protobuf import empty_pb2, text_format
from google.protobuf import message as _message

from bnrewrite.errors import InputFormatError
from bnrewrite.io.model import MESSAGE_NAMES, one_line, protos

#: How much of a file `sniff_head` looks at.
HEAD_BYTES = 1 << 16

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
_LENGTH_DELIMITED = frozenset({
    _descriptor.FieldDescriptor.TYPE_MESSAGE, _descriptor.FieldDescriptor.TYPE_STRING,
    _descriptor.FieldDescriptor.TYPE_BYTES,
})
_LENGTH_DELIMITED_WIRE = 2
_TEXT_KEYS = re.compile(
    r"(^|\s)(node|versions|library|meta_graphs|saved_model_schema_version|meta_info_def|graph_def|"
    r"collection_def|signature_def|saver_def|asset_file_def|object_graph_def|version)\s*[:{<]"
)
_NOT_A_MODEL = "not a TensorFlow GraphDef, MetaGraphDef or SavedModel"


def empty_error(shown: str) -> InputFormatError:
    return InputFormatError(f"{shown} is empty; point bnrewrite at a GraphDef, MetaGraphDef or SavedModel")


def sniff_head(head: bytes, shown: str) -> None:
    """Reject what is plainly not a model from its first bytes (no TensorFlow needed): known
    file signatures, blank files, and text that names none of the fields a text-format graph
    starts with."""
    if not head.strip():
        raise empty_error(shown)
    for magic, what in _MAGIC[:-1]:  # a pickle's first byte is also a valid protobuf tag
        if head.startswith(magic):
            raise InputFormatError(f"{shown} is {what}, {_NOT_A_MODEL}")
    partial = len(head) == HEAD_BYTES
    text = _as_text(head[:-4] if partial else head, partial=partial)  # a cut may split a UTF-8 character
    if text is not None and not _TEXT_KEYS.search(text):
        _raise_not_text_model(text, shown)


def parse_bytes(data: bytes, shown: str = "input") -> tuple[str, Any]:
    """(format, message) for the bytes of a GraphDef, MetaGraphDef or SavedModel file.

    format is "pb", "meta" or "savedmodel" for binary files, "pbtxt"/"metatxt"/"savedmodel"
    (with a text SavedModel) for text. Raises InputFormatError saying what the bytes are.
    """
    if not data.strip():
        raise empty_error(shown)
    fields = _top_level_fields(data)
    binary_problem = decode_error = ""
    for kind, cls, good in _candidates() if fields else ():
        if not _fits(fields, cls.DESCRIPTOR):
            continue
        message = cls()
        try:
            message.ParseFromString(data)
        except (_message.DecodeError, RuntimeError, ValueError) as exc:
            decode_error = decode_error or f"it does not decode as a {MESSAGE_NAMES[kind]} ({one_line(str(exc), 120)})"
            continue
        if _has_unknown_fields(message):
            continue  # a wire type `_fits` lets through that protobuf does not: another type's fields
        problem = good(message)
        if problem is None:
            return kind, message
        binary_problem = binary_problem or f"it parses as a {MESSAGE_NAMES[kind]} but {problem}"
    text = _as_text(data)
    if text is not None:
        return _parse_text(text, shown)
    for magic, what in _MAGIC:
        if data.startswith(magic):
            raise InputFormatError(f"{shown} is {what}, {_NOT_A_MODEL}")
    if fields is None:
        raise InputFormatError(
            f"{shown} is truncated, corrupt or not a GraphDef, MetaGraphDef or SavedModel: its {len(data)} bytes "
            "are not protobuf wire format (a field runs past the end of the file or is malformed); "
            "re-export the model or check the path"
        )
    detail = binary_problem or decode_error or "its fields match none of these message types"
    raise InputFormatError(
        f"{shown} is corrupt or not a GraphDef, MetaGraphDef or SavedModel: {detail}; re-export the model or check the path"
    )


def _top_level_fields(data: bytes) -> set[tuple[int, int]] | None:
    """(field number, wire type) of every top-level field, or None when `data` is not protobuf
    wire format: parsed as a message type without fields, protobuf keeps each field as an
    unknown one (its contents unread)."""
    empty = empty_pb2.Empty()
    try:
        empty.ParseFromString(data)
    except _message.DecodeError:
        return None
    return {(f.field_number, f.wire_type) for f in _unknown_fields(empty)}


def _fits(fields: set[tuple[int, int]], descriptor: Any) -> bool:
    """Every top-level field is one the message type declares, length-delimited (wire type 2)
    exactly when the type's field is a message, string, bytes or packed repeated scalar: a quick
    choice of which types to parse (protobuf checks the exact wire types while parsing)."""
    by_number = descriptor.fields_by_number
    for number, wire in fields:
        field = by_number.get(number)
        if field is None:
            return False
        delimited = field.type in _LENGTH_DELIMITED
        if (wire == _LENGTH_DELIMITED_WIRE) != delimited and not (wire == _LENGTH_DELIMITED_WIRE and _repeated(field)):
            return False
    return True


def _repeated(field: Any) -> bool:
    repeated = getattr(field, "is_repeated", None)
    if repeated is None:  # protobuf < 5.28
        return field.label == _descriptor.FieldDescriptor.LABEL_REPEATED
    return bool(repeated)


def _unknown_fields(message: Any) -> Any:
    """The top-level fields parsing kept that `message`'s type does not declare (or declares
    with another wire type)."""
    try:
        from google.protobuf import unknown_fields
    except ImportError:  # protobuf < 4.24 (TensorFlow 2.16 allows 3.20)
        return message.UnknownFields()
    return unknown_fields.UnknownFieldSet(message)


def _has_unknown_fields(message: Any) -> bool:
    return len(_unknown_fields(message)) > 0


def graph_problem(graph_def: Any) -> str | None:
    """What keeps a parsed GraphDef from being a real graph, or None."""
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
    return graph_problem(meta.graph_def)


def _saved_model_problem(saved: Any) -> str | None:
    if not saved.meta_graphs:
        return "it holds no MetaGraph"
    for i, meta in enumerate(saved.meta_graphs):
        problem = _meta_problem(meta)
        if problem:
            return f"its MetaGraph {i} {problem.removeprefix('it ')}"
    return None


def _candidates() -> tuple[tuple[str, type, Callable[[Any], str | None]], ...]:
    pb = protos()
    return (
        ("savedmodel", pb.SavedModel, _saved_model_problem),
        ("meta", pb.MetaGraphDef, _meta_problem),
        ("pb", pb.GraphDef, graph_problem),
    )


def _text_candidates() -> tuple[tuple[str, type, Callable[[Any], str | None], tuple[str, ...]], ...]:
    pb = protos()
    return (
        ("savedmodel", pb.SavedModel, _saved_model_problem, ("meta_graphs", "saved_model_schema_version")),
        ("metatxt", pb.MetaGraphDef, _meta_problem, ("meta_info_def", "graph_def", "collection_def", "signature_def")),
        ("pbtxt", pb.GraphDef, graph_problem, ("node", "versions", "library")),
    )


def _as_text(data: bytes, partial: bool = False) -> str | None:
    try:
        text = data.decode("utf-8", "ignore" if partial else "strict")
    except UnicodeDecodeError:
        return None
    printable = sum(ch.isprintable() or ch in "\t\r\n" for ch in text[:4096])
    return text if printable >= 0.95 * min(len(text), 4096) else None


def _raise_not_text_model(text: str, shown: str) -> None:
    if text.lstrip().startswith(("{", "[")):
        raise InputFormatError(f"{shown} is JSON (a Keras or TensorFlow.js model?), {_NOT_A_MODEL}")
    raise InputFormatError(f"{shown} is a text file but not a text-format GraphDef, MetaGraphDef or SavedModel")


def _parse_text(text: str, shown: str) -> tuple[str, Any]:
    errors: list[tuple[int, str, str]] = []
    for kind, cls, good, keys in _text_candidates():
        message = cls()
        try:
            text_format.Parse(text, message, allow_unknown_extension=False)
        except text_format.ParseError as exc:
            hits = sum(re.search(rf"(^|\s){k}\s*[:{{]", text) is not None for k in keys)
            errors.append((hits, MESSAGE_NAMES[kind], str(exc)))
            continue
        except (RecursionError, ValueError) as exc:
            errors.append((0, MESSAGE_NAMES[kind], str(exc)))
            continue
        problem = good(message)
        if problem is None:
            return kind, message
        errors.append((10, MESSAGE_NAMES[kind], problem))
    hits, name, error = max(errors, key=lambda e: e[0])
    if hits == 0 or text.lstrip().startswith(("{", "[")):
        _raise_not_text_model(text, shown)
    raise InputFormatError(f"{shown} is not a valid text-format {name} ({one_line(error)}); is it truncated or edited?")
