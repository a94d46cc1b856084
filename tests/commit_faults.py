"""Fault injection into the commit of `bnrewrite convert`'s outputs (run in a subprocess by
tests/test_outputs.py: it patches os and shutil for the whole process).

For each scene (old outputs at the targets, `--force`), one clean run counts the calls that
`Outputs.commit` makes to each patched function; then, for every call k of every function,
a run in which call k raises OSError (EBUSY) or KeyboardInterrupt, or sends the process a
real SIGINT, SIGTERM or SIGHUP before doing its work. After each run, the scene directory
must be exactly as before (and the message say nothing was written) or hold every new output
(exit 0, or the message says the interrupt came after the outputs were written); an old copy
left behind is allowed only when the output names it. Prints a JSON summary on stdout.

usage: python commit_faults.py MODELS_DIR WORK_DIR
"""

from __future__ import annotations

import contextlib
import errno
import io as std_io
import json
import os
import shutil
import signal
import sys
from collections import Counter

from model_files import tree_snapshot

from bnrewrite import cli
from bnrewrite import io as bnrewrite_io
from bnrewrite.io import Model, staging

PATCHED = [(os, "rename"), (os, "replace"), (os, "link"), (os, "remove"), (shutil, "rmtree")]
FAULTS = ["oserror", "interrupt", "SIGINT", "SIGTERM", "SIGHUP"]
EVENTS = "events.out.tfevents."


class Injector:
    """The patched functions: count calls while a commit runs; fault call `target`."""

    def __init__(self) -> None:
        self.active = False
        self.counts: Counter[str] = Counter()
        self.target: tuple[str, int, str] | None = None
        for module, name in PATCHED:
            setattr(module, name, self._wrap(module, name, getattr(module, name)))
        commit = staging.Outputs.commit

        def counted_commit(outputs: staging.Outputs) -> list[str]:
            self.active = True
            try:
                return commit(outputs)
            finally:
                self.active = False

        staging.Outputs.commit = counted_commit  # type: ignore[method-assign]

    def _wrap(self, module, name, real):
        key = f"{module.__name__}.{name}"

        def patched(*args, **kwargs):
            if self.active:
                self.counts[key] += 1
                if self.target is not None and self.target[:2] == (key, self.counts[key]):
                    fault = self.target[2]
                    if fault == "oserror":
                        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
                    if fault == "interrupt":
                        raise KeyboardInterrupt
                    os.kill(os.getpid(), getattr(signal, fault))
            return real(*args, **kwargs)

        return patched

    def run(self, argv: list[str], target: tuple[str, int, str] | None) -> tuple[int, str]:
        self.counts.clear()
        self.target = target
        out, err = std_io.StringIO(), std_io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
        self.target = None
        return code, out.getvalue() + err.getvalue()


def once_per_input(function):  # noqa: ANN001, ANN201 - io.load, io.rewrite
    """`function` (convert's load or rewrite) run once per distinct arguments: every trial of a
    scene loads and rewrites the same input to the same result, and the faults go into the
    commit that follows (a result that differed would show in the outputs `judge` compares
    with the clean run's). Arguments are keyed by value, a loaded Model by identity."""
    results: dict[str, object] = {}

    def cached(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        key = repr([id(a) if isinstance(a, Model) else a for a in args] + sorted(kwargs.items()))
        if key not in results:
            results[key] = function(*args, **kwargs)
        return results[key]

    return cached


def snapshot(root: str) -> dict[str, str]:
    """tree_snapshot, with event files (their names and contents hold times) by place only and
    a JSON report (it holds timings) as "report"."""
    shown = {}
    for name, what in tree_snapshot(root).items():
        head, tail = os.path.split(name)
        if tail.startswith(EVENTS):
            name, what = os.path.join(head, EVENTS + "*"), "events"
        elif tail == "r.json" and what.startswith("file"):
            with open(os.path.join(root, name), "rb") as f:
                what = "report" if f.read(1) == b"{" else what
        shown[name] = what
    return shown


def _put(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def scene_saved_model(models: str, root: str) -> list[str]:
    """Every output exists (an older SavedModel, report, picture and TensorBoard runs)."""
    shutil.copytree(os.path.join(models, "saved"), os.path.join(root, "out"))
    _put(os.path.join(root, "out", "old.txt"), b"old")
    _put(os.path.join(root, "r.json"), b"old report")
    _put(os.path.join(root, "d.dot"), b"old picture")
    for run in ("before", "after"):
        _put(os.path.join(root, "tb", run, "train", EVENTS + "1.old"), b"old events")
    return ["convert", os.path.join(models, "saved"), os.path.join(root, "out"), "--tags", "train", "--force",
            "--report", os.path.join(root, "r.json"), "--dot", os.path.join(root, "d.dot"),
            "--tensorboard", os.path.join(root, "tb")]


def scene_graph_file(models: str, root: str) -> list[str]:
    """OUT and the picture exist (files), the report and TensorBoard runs do not."""
    _put(os.path.join(root, "out.pb"), b"old graph")
    _put(os.path.join(root, "d.dot"), b"old picture")
    return ["convert", os.path.join(models, "towers.pb"), os.path.join(root, "out.pb"), "--force",
            "--report", os.path.join(root, "r.json"), "--dot", os.path.join(root, "d.dot"),
            "--tensorboard", os.path.join(root, "tb")]


def judge(before: dict, new: dict, after: dict, code: int, text: str) -> str:
    """'before', 'new', 'new, old copy named' or what is wrong."""
    if after == before:
        return "before" if code != 0 and "nothing was written" in text else f"unchanged but exit {code}: {text!r}"
    named = {k: v for k, v in after.items() if k.split(os.sep)[0] not in text or not k.startswith(staging.OLD_PREFIX)}
    if named == new:
        written = code == 0 or "after every output was written" in text
        if not written:
            return f"written but exit {code}: {text!r}"
        return "new" if named == after else "new, old copy named"
    diff = sorted(set(named.items()) ^ set(new.items()))[:6]
    return f"mixed or left over (exit {code}: {text.strip()[-300:]!r}); differs from the new outputs at {diff}"


def main(models: str, work: str) -> dict:
    bnrewrite_io.load, bnrewrite_io.rewrite = once_per_input(bnrewrite_io.load), once_per_input(bnrewrite_io.rewrite)
    inputs = {p: tree_snapshot(os.path.join(models, p)) for p in ("saved", "towers.pb")}
    injector = Injector()
    summary: dict = {"trials": 0, "outcomes": Counter(), "bad": [], "steps": {}}
    for scene in (scene_saved_model, scene_graph_file):
        root = os.path.join(work, scene.__name__)

        def fresh() -> list[str]:
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            return scene(models, root)

        argv = fresh()
        before = snapshot(root)
        code, text = injector.run(argv, None)
        assert code == 0, text
        new, steps = snapshot(root), dict(injector.counts)
        summary["steps"][scene.__name__] = steps
        for key, calls in steps.items():
            for k in range(1, calls + 1):
                for fault in FAULTS:
                    argv = fresh()
                    code, text = injector.run(argv, (key, k, fault))
                    verdict = judge(before, new, snapshot(root), code, text)
                    summary["trials"] += 1
                    summary["outcomes"][verdict if verdict in ("before", "new", "new, old copy named") else "bad"] += 1
                    if verdict not in ("before", "new", "new, old copy named"):
                        summary["bad"].append(f"{scene.__name__} {key} call {k} {fault}: {verdict}")
    summary["inputs_untouched"] = all(tree_snapshot(os.path.join(models, p)) == s for p, s in inputs.items())
    return summary


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
