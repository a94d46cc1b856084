"""Telling a model's format from its content, not its name.

Before anything is parsed (and before TensorFlow is imported), a walk over the top-level
protobuf fields of the bytes, one field at a time and keeping nothing per field, decides
which of SavedModel, MetaGraphDef and GraphDef they can be: every field number and wire type
must be one the type declares, a singular field must appear once, and a repeated message
must be long enough to hold a name. Bytes that are not wire format at all, or fit none of
the types, are rejected there, named as what they look like (zero bytes, a checkpoint
index, an image, ...). Only then is the one candidate protobuf can still take parsed, and
accepted when it holds a real graph (nodes with names and op types).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from google.protobuf import message as _message
from google.protobuf import text_format

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
_VARINT, _FIXED64, _DELIMITED, _FIXED32 = 0, 1, 2, 5
#: The top-level fields of each message type the sniffer tells apart: number -> (wire type,
#: repeated). Written out so that sniffing needs no TensorFlow; a test checks them against
#: TensorFlow's descriptors.
FIELDS: dict[str, dict[int, tuple[int, bool]]] = {
    "savedmodel": {1: (_VARINT, False), 2: (_DELIMITED, True)},
    "meta": {1: (_DELIMITED, False), 2: (_DELIMITED, False), 3: (_DELIMITED, False), 4: (_DELIMITED, True),
             5: (_DELIMITED, True), 6: (_DELIMITED, True), 7: (_DELIMITED, False)},
    "pb": {1: (_DELIMITED, True), 2: (_DELIMITED, False), 3: (_VARINT, False), 4: (_DELIMITED, False),
           5: (_DELIMITED, False)},
}
#: A repeated message of these types (a node, a MetaGraph, a collection) shorter than this
#: cannot hold a name: such entries are not a model's, and parsing millions of them would
#: take many times the file's size in memory.
_MIN_ENTRY = 4
#: The last 8 bytes of a LevelDB table, the format of a checkpoint's .index file.
_TABLE_MAGIC = bytes.fromhex("57fb808b247547db")
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


class _NotWire(Exception):
    """The bytes are not protobuf wire format; the message says where and why."""


def candidates(data: Any) -> list[str]:
    """The binary formats ("savedmodel", "meta", "pb", in that order) whose top-level fields
    `data` (bytes, or an mmap of a file) fits. Raises _NotWire when it is not wire format.

    One pass over the top-level fields, skipping their contents; it stops as soon as no
    type fits, so garbage is rejected after a few fields whatever the file's size.
    """
    alive = dict.fromkeys(FIELDS)
    seen: set[int] = set()
    size, pos = len(data), 0
    while pos < size and alive:
        start = pos
        tag, pos = _varint(data, pos, size)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise _NotWire(f"byte {start} is not a field tag" + (" (it is a zero byte)" if data[start] == 0 else ""))
        if wire == _VARINT:
            _, pos = _varint(data, pos, size)
            length = 0
        elif wire == _DELIMITED:
            length, pos = _varint(data, pos, size)
            pos += length
        elif wire in (_FIXED64, _FIXED32):
            pos += 8 if wire == _FIXED64 else 4
            length = 0
        else:
            raise _NotWire(f"the field at byte {start} has wire type {wire}, which no model uses")
        if pos > size:
            raise _NotWire(f"the field at byte {start} runs {pos - size} bytes past the end of the file")
        for kind in list(alive):
            declared = FIELDS[kind].get(number)
            if (declared is None or declared[0] != wire or (not declared[1] and number in seen)
                    or (declared[1] and wire == _DELIMITED and length < _MIN_ENTRY)):
                del alive[kind]
        seen.add(number)
    return list(alive)


def _varint(data: Any, pos: int, size: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= size:
            raise _NotWire(f"a field tag or length at byte {pos} runs past the end of the file")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift >= 64:
            raise _NotWire(f"a varint ending at byte {pos} is longer than 10 bytes")


def what_it_is(data: Any) -> str | None:
    """What binary bytes that are no model look like, from their first and last bytes."""
    for magic, what in _MAGIC:
        if data[: len(magic)] == magic:
            return what
    if len(data) >= 48 and data[-8:] == _TABLE_MAGIC:
        return "a TensorFlow checkpoint's .index file (pass the .meta graph saved with the checkpoint instead)"
    head = data[: min(len(data), HEAD_BYTES)]
    if not head.strip(b"\0"):
        return ("all zero bytes" if len(head) == len(data) else f"zero bytes (its first {len(head)} bytes at least)") + (
            ", like a checkpoint's .data shard of zero-initialised variables")
    return None


def check_binary(data: Any, shown: str) -> list[str]:
    """The formats `data` can be (see `candidates`), without TensorFlow; raises InputFormatError
    naming what the bytes are when they can be none (and are not text, which TensorFlow parses)."""
    try:
        kinds = candidates(data)
    except _NotWire as exc:
        kinds, why = [], f"{len(data)} bytes that are not protobuf wire format ({exc})"
    else:
        why = "its top-level fields match none of these message types"
    if kinds or _as_text(data[:HEAD_BYTES], partial=len(data) > HEAD_BYTES) is not None:
        return kinds
    what = what_it_is(data)
    if what is not None:
        raise InputFormatError(f"{shown} is {what}, {_NOT_A_MODEL}")
    raise InputFormatError(
        f"{shown} is truncated, corrupt or not a GraphDef, MetaGraphDef or SavedModel: {why}; "
        "re-export the model or check the path"
    )


def parse_bytes(data: bytes, shown: str = "input") -> tuple[str, Any]:
    """(format, message) for the bytes of a GraphDef, MetaGraphDef or SavedModel file.

    format is "pb", "meta" or "savedmodel" for binary files, "pbtxt"/"metatxt"/"savedmodel"
    (with a text SavedModel) for text. Raises InputFormatError saying what the bytes are.
    """
    if not data.strip():
        raise empty_error(shown)
    kinds = check_binary(data, shown)
    binary_problem = decode_error = ""
    undecoded: list[str] = []
    for kind, cls, good in _candidates():
        if kind not in kinds:
            continue
        message = cls()
        try:
            message.ParseFromString(data)
        except (_message.DecodeError, RuntimeError, ValueError) as exc:
            undecoded.append(MESSAGE_NAMES[kind])
            decode_error = decode_error or one_line(str(exc), 120)
            continue
        problem = good(message)
        if problem is None:
            return kind, message
        binary_problem = binary_problem or f"it parses as a {MESSAGE_NAMES[kind]} but {problem}"
    text = _as_text(data)
    if text is not None:
        return _parse_text(text, shown)
    if decode_error and not binary_problem:
        binary_problem = (f"its top-level fields fit a {' or a '.join(undecoded)} but their contents do not "
                          f"decode as {'either' if len(undecoded) > 1 else 'one'} ({decode_error})")
    detail = binary_problem or "its top-level fields match none of these message types"
    raise InputFormatError(
        f"{shown} is corrupt or not a GraphDef, MetaGraphDef or SavedModel: {detail}; re-export the model or check the path"
    )


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
