"""What a pass did, for the report."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PassRecord:
    name: str
    added: int = 0
    replaced: list[str] = field(default_factory=list)
    removed: list[tuple[str, str]] = field(default_factory=list)  # (node, why)
    collectives: list[str] = field(default_factory=list)
    #: site -> (global mean, global biased variance) tensors it made: float32, flat [C]
    moments: dict[str, tuple[str, str]] = field(default_factory=dict)
    control_edges: int = 0
    seconds: float = 0.0
