"""Writing outputs: one rule for what may be replaced, and all outputs or none.

The rule (docs/outputs.md): a path that does not exist is created; one that exists is
replaced only with --force, and only when it holds what bnrewrite writes there (`KINDS`);
anything else (another directory, a link, a FIFO, a device) is refused.

Every output is first staged under a temporary name beside its target (`TEMP_PREFIX`), and
only when all of them are complete does `Outputs.commit` put them in place: each old one is
moved aside (`OLD_PREFIX`), each new one moved in, and on any failure or interrupt every old
one is moved back. SIGINT, SIGTERM and SIGHUP are held while temporary names are made and
while the commit or rollback runs, so every path ends up as it was, or every output new;
every exit path removes the temporary names.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from bnrewrite.errors import OutputError
from bnrewrite.io.model import SAVED_MODEL_PB, SAVED_MODEL_PBTXT, shown

#: Names of staged outputs and of old ones moved aside during a commit: the prefix, the
#: target's name, "-", the writing process's id, "-", 8 random characters (tempfile's).
TEMP_PREFIX = ".bnrewrite-tmp-"
OLD_PREFIX = ".bnrewrite-old-"
_TAIL = re.compile(r"(\d+)-[a-z0-9_]{8}")
#: The signals held during a commit (those that ask a process to stop and may be handled).
SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

#: Output kinds -> what may be replaced there (with --force).
FILE, SAVED_MODEL, LOGDIR = "file", "savedmodel", "logdir"
KINDS = {
    FILE: "a regular file",
    SAVED_MODEL: "a SavedModel directory or an empty directory",
    LOGDIR: "a TensorBoard directory bnrewrite wrote (only before/ and after/ event-file runs) or an empty directory",
}
_EVENTS = "events.out.tfevents."


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


def describe(path: str) -> str:
    """What is at `path`, as a message shows it (the path itself, links not followed)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "nothing"
    if stat.S_ISLNK(mode):
        return f"a symbolic link to {shown(os.readlink(path))}"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        try:
            names = sorted(os.listdir(path))
        except OSError as exc:
            return f"a directory bnrewrite cannot list ({exc.strerror or exc})"
        if _is_saved_model(path):
            return "a SavedModel directory"
        if not names:
            return "an empty directory"
        shown_names = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return f"a directory of {len(names)} entr{'y' if len(names) == 1 else 'ies'} ({shown_names})"
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def replaceable(path: str, kind: str) -> bool:
    """Whether what is at `path` is what bnrewrite writes for an output of `kind`."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    if kind == FILE:
        return stat.S_ISREG(mode)
    if not stat.S_ISDIR(mode):
        return False
    if kind == SAVED_MODEL:
        return _is_saved_model(path) or not os.listdir(path)
    return _is_logdir(path)


def _is_saved_model(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) and not os.path.islink(os.path.join(path, name))
               for name in (SAVED_MODEL_PB, SAVED_MODEL_PBTXT))


def _is_logdir(path: str) -> bool:
    """Only before/ and after/ (real directories) holding event files, directly or in one
    subdirectory per MetaGraph: what `--tensorboard` writes."""
    try:
        top = os.listdir(path)
        if not set(top) <= {"before", "after"}:
            return False
        for run in top:
            for root, dirs, files in os.walk(os.path.join(path, run)):
                if os.path.islink(root) or not stat.S_ISDIR(os.lstat(root).st_mode):
                    return False
                for name in files:  # os.walk lists links to directories among dirs, others among files
                    if not name.startswith(_EVENTS) or not stat.S_ISREG(os.lstat(os.path.join(root, name)).st_mode):
                        return False
                if root != os.path.join(path, run) and dirs:
                    return False
    except OSError:
        return False
    return True


def check_output(path: str, inputs: Iterable[str], force: bool, what: str = "output", kind: str = FILE) -> None:
    """Raise OutputError when `path` cannot or must not be written (the rule above)."""
    where = shown(path)
    for source in inputs:
        if same_or_nested(path, source):
            relation = "is" if os.path.realpath(path) == os.path.realpath(source) else "overlaps"
            raise OutputError(
                f"{what} {where} {relation} the input {shown(source)}; write to a new path (bnrewrite never overwrites its input)"
            )
    check_target(path, kind, force, what)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        problem = "is not a directory" if os.path.lexists(parent) else "does not exist"
        raise OutputError(f"cannot write {where}: {shown(parent)} {problem}; create the directory first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {where}: directory {shown(parent)} is not writable")


def check_target(path: str, kind: str, force: bool, what: str) -> None:
    """Raise OutputError when something is at `path` that this output may not replace."""
    if not os.path.lexists(path):
        return
    there = describe(path)
    if not replaceable(path, kind):
        raise OutputError(
            f"{what} {shown(path)} is {there}; bnrewrite replaces only {KINDS[kind]} there, even with --force: "
            "choose another path"
        )
    if not force:
        raise OutputError(f"{what} {shown(path)} already exists ({there}); pass --force to replace it, or choose a new path")


def _alive(pid: int) -> bool:
    """Whether process `pid` may still run (any doubt: yes)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process, or no valid pid: not provably gone
        return True
    return True


def leftovers(path: str) -> tuple[list[str], list[str]]:
    """The temporary and old-copy names of `path` beside it that a bnrewrite process no longer
    running left (killed mid-write, e.g. by SIGKILL): name pattern exact, process id dead."""
    parent, base = os.path.split(os.path.abspath(path))
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return [], []
    found: tuple[list[str], list[str]] = ([], [])
    for prefix, into in zip((TEMP_PREFIX, OLD_PREFIX), found):
        head = f"{prefix}{base}-"
        for name in names:
            match = _TAIL.fullmatch(name, len(head)) if name.startswith(head) else None
            if match is not None and not _alive(int(match.group(1))):
                into.append(os.path.join(parent, name))
    return found


def clear_leftovers(path: str, what: str = "output") -> list[str]:
    """Deal with what a killed run left beside output `path`; returns notes for the user.

    An old copy with `path` itself missing: a run was killed mid-replacement, and the copy is
    the only one of the earlier content: OutputError saying how to put it back. Otherwise
    temporary names (never committed) and old copies that are hard links of `path` (the same
    file) are removed: scratch of a dead bnrewrite process, nothing lost. An old copy of
    other content (the killed run had already put its new output in place) is kept, and said."""
    temps, olds = leftovers(path)
    where = shown(path)
    if olds and not os.path.lexists(path):
        more = f" (older ones: {', '.join(shown(o) for o in olds[1:])})" if len(olds) > 1 else ""
        raise OutputError(
            f"a previous bnrewrite run was killed while replacing {what} {where}: its earlier content is at "
            f"{shown(olds[0])}{more}; restore it with `mv {shlex.quote(olds[0])} {shlex.quote(path)}` (or delete it), "
            "then run again; nothing was written")
    duplicates = [o for o in olds if _same_file(o, path)]
    scratch = temps + duplicates
    left = _remove_all(scratch)
    removed = [p for p in scratch if shown(p) not in left]
    notes = []
    if removed:
        notes.append(f"removed {len(removed)} leftover(s) of {what} {where} from a killed bnrewrite run: "
                     + ", ".join(shown(os.path.basename(p)) for p in removed))
    if left:
        notes.append(f"leftovers of {what} {where} from a killed bnrewrite run could not be removed: {', '.join(left)}")
    kept = [o for o in olds if o not in duplicates]
    if kept:
        notes.append(f"a killed bnrewrite run replaced {what} {where} but left its earlier content at "
                     f"{', '.join(shown(o) for o in kept)}; delete it if you do not need it")
    return notes


def _same_file(a: str, b: str) -> bool:
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    return stat.S_ISREG(sa.st_mode) and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


@contextmanager
def held_signals() -> Iterator[list[int]]:
    """Hold SIGINT, SIGTERM and SIGHUP for the block: the list yielded collects those that
    arrive, and they are raised again (through the handlers they had) when the block ends.
    Only the main thread handles signals; elsewhere this holds nothing. An ignored signal
    stays ignored."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = {}
    for signum in SIGNALS:
        if signal.getsignal(signum) not in (signal.SIG_IGN, None):
            previous[signum] = signal.signal(signum, lambda s, _frame: caught.append(s))
    try:
        yield caught
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


@dataclass
class _Staged:
    temp: str
    final: str
    kind: str
    what: str
    #: The old output, moved aside (or, for a file, hard-linked aside) during the commit.
    aside: str | None = None
    linked: bool = False
    placed: bool = False


@dataclass
class Outputs:
    """Outputs staged under temporary names beside their targets; `commit` puts them in place.

    `force`: existing targets may be replaced (only those `replaceable` for their kind)."""

    force: bool = False
    staged: list[_Staged] = field(default_factory=list)
    #: True once every output is in place (a later interrupt no longer undoes anything).
    committed: bool = False

    def stage_bytes(self, path: str, data: bytes, what: str = "output") -> None:
        """Stage a file output holding `data`."""
        item = self._temp(path, FILE, what)
        try:
            with open(item.temp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(item.temp, 0o666 & ~_umask())
        except OSError as exc:
            raise OutputError(f"cannot write {shown(path)}: {exc.strerror or exc}") from None

    def stage_dir(self, path: str, build: Callable[[str], None], kind: str = SAVED_MODEL, what: str = "output") -> None:
        """`build(temp_dir)` fills a fresh directory that becomes `path` on commit."""
        item = self._temp(path, kind, what)
        try:
            build(item.temp)
            os.chmod(item.temp, 0o777 & ~_umask())
        except OSError as exc:
            raise OutputError(f"cannot write {shown(path)}: {exc.strerror or exc}") from None

    def _temp(self, path: str, kind: str, what: str) -> _Staged:
        check_target(path, kind, self.force, what)
        parent, base = os.path.split(os.path.abspath(path))
        prefix = f"{TEMP_PREFIX}{base}-{os.getpid()}-"
        with held_signals():  # the name is recorded before any interrupt can leave it behind
            try:
                if kind == FILE:
                    handle, temp = tempfile.mkstemp(prefix=prefix, dir=parent)
                    os.close(handle)
                else:
                    temp = tempfile.mkdtemp(prefix=prefix, dir=parent)
            except OSError as exc:
                raise OutputError(f"cannot write {shown(path)}: {exc.strerror or exc}") from None
            item = _Staged(temp, path, kind, what)
            self.staged.append(item)
        return item

    def commit(self) -> list[str]:
        """Put every staged output in place, or (on any error or interrupt) none of them.

        Raises OutputError when a target no longer fits the rule or a move fails; every path
        is then as it was before (or the message says where an old output was left).
        Returns notes for the user (old outputs that could not be removed afterwards)."""
        interrupted, notes = False, []
        with held_signals() as caught:
            try:
                for item in self.staged:
                    check_target(item.final, item.kind, self.force, item.what)
                for item in self.staged:
                    self._place(item)
                if caught:
                    interrupted = True
                    self.rollback()
            except BaseException as exc:
                failed = next((i for i in self.staged if not i.placed), None)
                self.rollback()
                if isinstance(exc, OSError):
                    where = shown(failed.final if failed else exc.filename or "")
                    raise OutputError(f"cannot write {where}: {exc.strerror or exc}; nothing was written") from None
                raise
            if not interrupted:
                self.committed = True
                left = _remove_all([i.aside for i in self.staged if i.aside])
                self.staged.clear()
                if left:
                    notes.append(f"the replaced outputs' old copies {', '.join(left)} could not be removed; remove them")
        if interrupted:  # the handler of the signal did not raise
            raise KeyboardInterrupt
        return notes

    def _place(self, item: _Staged) -> None:
        final = item.final
        parent, base = os.path.split(os.path.abspath(final))
        if os.path.lexists(final):
            item.aside = os.path.join(parent, f"{OLD_PREFIX}{base}-{os.getpid()}-{item.temp[-8:]}")
            if item.kind == FILE:
                try:  # the old file stays at `final` until the new one replaces it in one step
                    os.link(final, item.aside)
                    item.linked = True
                except OSError:
                    pass
            if not item.linked:
                os.rename(final, item.aside)
        if item.linked:
            os.replace(item.temp, final)
        else:
            os.rename(item.temp, final)
        item.placed = True

    def rollback(self) -> None:
        """Put back every old output moved aside, and remove every staged one.

        Raises OutputError when an old output cannot be put back (naming where it is)."""
        with held_signals():
            lost: list[str] = []
            for item in reversed(self.staged):
                try:
                    _undo(item)
                except BaseException as exc:  # noqa: BLE001 - keep undoing the others, then say which failed
                    lost.append(f"{shown(item.final)} (the previous one is at {shown(item.aside or '')}: "
                                f"{getattr(exc, 'strerror', None) or exc or type(exc).__name__})")
            left = _remove_all([i.temp for i in self.staged if not i.placed])
            self.staged.clear()
        if lost or left:
            raise OutputError("could not restore " + "; ".join(lost) if lost else
                              f"could not remove the temporary {', '.join(left)}")

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.rollback()


def _undo(item: _Staged) -> None:
    """Put the old output of one item back (a new one in place goes back to its temporary name)."""
    aside = item.aside if item.aside is not None and os.path.lexists(item.aside) else None
    if item.linked and aside is not None:
        if item.placed:
            os.replace(aside, item.final)  # the new file is discarded
            item.placed = False
        else:
            os.remove(aside)
    else:
        if item.placed:
            os.rename(item.final, item.temp)
            item.placed = False
        if aside is not None:
            os.rename(aside, item.final)
    item.aside = None


def _remove_all(paths: list[str]) -> list[str]:
    """Remove each path (file or directory tree); those that could not be removed, shown."""
    left = []
    for path in paths:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.remove(path)
        except BaseException:  # noqa: BLE001 - an interrupt here must not leave the others behind
            if os.path.lexists(path):
                left.append(shown(path))
    return left


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
