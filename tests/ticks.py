"""An exception at any bytecode: a sys.settrace tracer counts the trace events (each opcode,
line, call, return) from the first call of one code object on, and at the n-th event calls an
action that raises, or sends a signal whose handler raises. An exception a tracer raises
surfaces in the traced frame at that bytecode, as one a signal handler raises does; it also
switches the tracer off, so the code that handles it runs untraced."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, NamedTuple


class Tick(NamedTuple):
    code: CodeType
    line: int | None
    offset: int
    event: str


def run_ticked(call: Callable[[], Any], start: CodeType, outer: CodeType, n: int = 0,
               action: Callable[[], None] | None = None) -> list[Tick]:
    """call() traced from the first call of `start` to the end of `outer` (a caller of it, whose
    frames between are traced too); `action` runs at the n-th event (n counts from 1; 0: never).
    Returns the events seen; whatever call() raises propagates."""
    ticks: list[Tick] = []

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        ticks.append(Tick(frame.f_code, frame.f_lineno, frame.f_lasti, event))
        if len(ticks) == n and action is not None:
            action()
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if not ticks:
            if frame.f_code is not start:
                return None
            caller = frame.f_back
            while caller is not None:  # its callers' remaining bytecodes count too
                caller.f_trace, caller.f_trace_opcodes = local, True
                if caller.f_code is outer:
                    break
                caller = caller.f_back
        return local(frame, event, arg)

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return ticks


def spread(ticks: list[Tick], inside: Callable[[CodeType], bool], every: str = "line") -> list[int]:
    """Tick numbers (from 1) to interrupt at: the first and last, and the first tick of each
    distinct line (every="line") or of each distinct bytecode and its last (every="offset")
    of the code objects `inside` accepts."""
    first: dict[tuple, int] = {}
    last: dict[tuple, int] = {}
    for i, tick in enumerate(ticks, 1):
        if inside(tick.code):
            key = (tick.code, tick.line) if every == "line" else (tick.code, tick.offset, tick.event)
            first.setdefault(key, i)
            last[key] = i
    chosen = {1, len(ticks), *first.values(), *(last.values() if every == "offset" else ())}
    return sorted(chosen)
