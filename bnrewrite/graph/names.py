"""Node and tensor names as a GraphDef's inputs spell them, below every module that reads them
(the graph model, shape inference, matching, passes): one spelling, parsed in one place."""

from __future__ import annotations


def parse_input(spec: str) -> tuple[str, int]:
    """'a:1' -> ('a', 1); 'a' -> ('a', 0); '^a' -> ('a', -1)."""
    if spec.startswith("^"):
        return spec[1:], -1
    name, sep, index = spec.rpartition(":")
    if sep and index.isdigit():
        return name, int(index)
    return spec, 0


def tensor_name(node: str, output: int = 0) -> str:
    """The input string that reads `output` of `node`."""
    return node if output == 0 else f"{node}:{output}"
