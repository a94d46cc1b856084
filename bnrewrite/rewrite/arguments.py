"""The rewrite's keyword arguments and their checks, importable without TensorFlow.

`rewrite_graph`, `enable()` and the command line share them; `enable()` (and so `bnrewrite
run`) must refuse a bad option before the user's script has imported TensorFlow.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from bnrewrite.errors import BackendError, BnRewriteError

BACKENDS = ("auto", "nccl", "local", "collective", "ps")
TOWER_BY = ("auto", "device", "scope")


def check_arguments(
    backend: Any, tower_by: Any, group_size: Any, timeout_seconds: Any, num_workers: Any, task_index: Any,
    if_rewritten: Any = "error", in_place: Any = False,
) -> None:
    """Raise BnRewriteError naming the valid values for the first argument that has none of them
    (the types too: a string "2" is no group size)."""
    for name, value, choices, error in (("backend", backend, BACKENDS, BackendError),
                                        ("tower_by", tower_by, TOWER_BY, BnRewriteError),
                                        ("if_rewritten", if_rewritten, ("error", "keep"), BnRewriteError)):
        if not isinstance(value, str) or value not in choices:
            raise error(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")
    if group_size is not None and not (_is_int(group_size) and group_size >= 1):
        raise BnRewriteError(f"group_size={group_size!r} is not valid; give a positive integer (1 or more) "
                             "that divides the number of towers, or None for all towers together")
    check_seconds("timeout_seconds", timeout_seconds)
    if not (_is_int(num_workers) and num_workers >= 1):
        raise BnRewriteError(f"num_workers={num_workers!r} is not valid; give a positive integer (1 or more)")
    if not (_is_int(task_index) and 0 <= task_index < num_workers):
        raise BnRewriteError(f"task_index={task_index!r} is not valid; give an integer from 0 to "
                             f"{num_workers - 1} (num_workers {num_workers})")
    if not isinstance(in_place, bool):
        raise BnRewriteError(f"in_place={in_place!r} is not valid; give True or False")


def check_seconds(name: str, value: Any, positive: bool = False) -> None:
    """A finite number of seconds, 0 or more (more than 0 if `positive`), or BnRewriteError naming it."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value > 0 if positive else value >= 0)):
        raise BnRewriteError(f"{name}={value!r} is not valid; give a finite number of seconds, "
                             + ("more than 0" if positive else "0 or more (0: no timeout)"))


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
