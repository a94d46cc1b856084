"""Commit `convert`'s outputs for a SavedModel OUT and a --report file, with --force, and die
as a SIGKILL would leave it (os._exit, no cleanup) right before call K of the file operations
the commit makes (os.rename, os.replace, os.link, os.remove, shutil.rmtree). Run in a
subprocess by tests/test_outputs.py; imports no TensorFlow.

usage: python killed_commit.py OUT REPORT K    (K = 0: no kill; prints how many calls were made)
"""

from __future__ import annotations

import os
import shutil
import sys

from bnrewrite.io import staging


def main() -> None:
    out, report, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    outputs = staging.Outputs(force=True)
    outputs.stage_dir(out, lambda d: open(os.path.join(d, "saved_model.pb"), "wb").write(b"new model"))
    outputs.stage_bytes(report, b"new report", "--report")
    calls = 0
    for module, name in ((os, "rename"), (os, "replace"), (os, "link"), (os, "remove"), (shutil, "rmtree")):
        def patched(*args, _real=getattr(module, name), **kwargs):
            nonlocal calls
            calls += 1
            if calls == kill_at:
                os._exit(9)
            return _real(*args, **kwargs)

        setattr(module, name, patched)
    outputs.commit()
    print(calls)


if __name__ == "__main__":
    main()
