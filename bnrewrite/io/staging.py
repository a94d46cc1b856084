"""Writing outputs atomically and all or nothing.

Every output is first staged under a temporary name in its target's directory
(`Outputs.stage_*`), and only when all of them are complete are they renamed into place
(`Outputs.commit`). On any error the staged files are removed, so a failed run leaves
neither partial output nor a changed input.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from bnrewrite.errors import OutputError
from bnrewrite.io.model import shown


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
    where = shown(path)
    for source in inputs:
        if same_or_nested(path, source):
            relation = "is" if os.path.realpath(path) == os.path.realpath(source) else "overlaps"
            raise OutputError(
                f"{what} {where} {relation} the input {shown(source)}; write to a new path (bnrewrite never overwrites its input)"
            )
    if os.path.lexists(path) and not force:
        raise OutputError(f"{what} {where} already exists; pass --force to overwrite it, or choose a new path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        problem = "is not a directory" if os.path.lexists(parent) else "does not exist"
        raise OutputError(f"cannot write {where}: {shown(parent)} {problem}; create the directory first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {where}: directory {shown(parent)} is not writable")


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
            raise OutputError(f"cannot make directory {shown(path)}: {exc.strerror or exc}") from None
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
            raise OutputError(f"cannot write {shown(path)}: {exc.strerror or exc}") from None

    def stage_dir(self, path: str, build: Callable[[str], None]) -> None:
        """`build(temp_dir)` fills a fresh directory that becomes `path` on commit."""
        parent = os.path.dirname(os.path.abspath(path))
        temp = self._temp(path, lambda: (None, tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)))
        try:
            build(temp)
            os.chmod(temp, 0o777 & ~_umask())
        except OSError as exc:
            raise OutputError(f"cannot write {shown(path)}: {exc.strerror or exc}") from None

    def _temp(self, path: str, make: Callable[[], tuple[Any, str]]) -> str:
        try:
            handle, temp = make()
        except OSError as exc:
            raise OutputError(f"cannot write {shown(path)}: {exc.strerror or exc}") from None
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
                raise OutputError(f"cannot write {shown(item.final)}: {exc.strerror or exc}") from None
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
        except OSError:  # already gone, or not ours to remove: nothing to roll back
            pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
