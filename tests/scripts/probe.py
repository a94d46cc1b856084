"""Prints, as JSON, what a script sees of how it was started (no TensorFlow), then exits with
the code its first argument names: 'raise' raises ValueError, 'exit:N' calls sys.exit(N)."""

import json
import os
import sys

print(json.dumps({"argv": sys.argv, "name": __name__, "file": globals().get("__file__"), "path0": sys.path[0],
                  "cwd": os.getcwd(), "stdin": sys.stdin.read(), "tensorflow_imported": "tensorflow" in sys.modules}))
sys.stdout.flush()
what = sys.argv[1] if len(sys.argv) > 1 else ""
if what == "raise":
    raise ValueError("the script's own error")
if what.startswith("exit:"):
    sys.exit(int(what[5:]))
