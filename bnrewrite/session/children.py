"""`bnrewrite run` follows the script's multiprocessing children into their own interpreters.

A 'fork' child inherits the patched session class and trains synchronized as it is. A 'spawn'
child starts a fresh interpreter with `python -c "from multiprocessing.spawn import spawn_main;
spawn_main(...)"`: the start-up hook (as coverage.py measures subprocesses) is that command,
made by multiprocessing.spawn.get_command_line, which `follow()` wraps so that the child first
calls `start(options)`, i.e. `enable(**options)` with run's options, before multiprocessing
prepares it and runs its target. Nothing is added to the script's environment. A 'forkserver'
child forks from a server started without the hook: a warning says so at its first start.

Invariant: every multiprocessing child of a script under `bnrewrite run` has its sessions
synchronized as the script's are, or a line on stderr says it is not.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import bnrewrite

#: The folder bnrewrite is imported from, put first on a spawned child's sys.path for the hook.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(bnrewrite.__file__)))


def follow(options: dict[str, Any]) -> None:
    """Make every multiprocessing child that this process spawns call `start(options)` first,
    and warn once when a forkserver child starts (those are not followed)."""
    import multiprocessing.forkserver
    import multiprocessing.spawn

    command_line = multiprocessing.spawn.get_command_line
    ensure_running = multiprocessing.forkserver.ForkServer.ensure_running

    def get_command_line(**kwds: Any) -> list[str]:
        args = command_line(**kwds)
        if "-c" in args:
            i = args.index("-c") + 1
            args[i] = (f"import sys; sys.path.insert(0, {_ROOT!r}); import bnrewrite.session.children; sys.path.pop(0); "
                       f"bnrewrite.session.children.start({options!r}); {args[i]}")
        return args

    warned = []

    def ensure_running_warned(self: Any) -> None:
        if not warned:
            warned.append(True)
            print("bnrewrite: warning: multiprocessing 'forkserver' children are not followed: their sessions run "
                  "UNSYNCHRONIZED; use the 'spawn' or 'fork' start method", file=sys.stderr, flush=True)
        ensure_running(self)

    multiprocessing.spawn.get_command_line = get_command_line
    multiprocessing.forkserver.ForkServer.ensure_running = ensure_running_warned


def start(options: dict[str, Any]) -> None:
    """In a spawned child, before its target runs: its sessions as the parent's (and its own
    spawned children followed too)."""
    from bnrewrite.session import sessions

    sessions.enable(**options)
    follow(options)
