"""One worker of a 2-worker collective cluster on localhost, as a user runs it under `bnrewrite run`.

The graph is examples/multi_worker.py's (2 towers on the worker's own CPU devices, gradients
averaged across workers by the script's own CollectiveReduceV2, no time-outs anywhere), built
unrewritten; the worker trains STEPS steps in a plain Session on its server and writes its
losses and variables to OUT/worker<I>.npz. Unlike the example it does not wait for the leader
itself: bounding that wait is bnrewrite's job under `run`.

Usage: collective_worker.py --task I --hosts JSON --out DIR [--steps S] [--delay SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "examples")]

import numpy as np  # noqa: E402

import multi_worker as mw  # noqa: E402
import towers_model as tm  # noqa: E402

SPEC = tm.Spec(towers=4, batch=4)  # the global job: 2 workers x 2 towers x 4 examples


def launch(out: str, tasks: dict[int, list[str] | None], delays: dict[int, float] | None = None,
           deadline: float = 150.0, script: str = __file__, popen: Callable = subprocess.Popen,
           ) -> dict[int, subprocess.CompletedProcess]:
    """Start `script` (this one; it takes --task I --hosts JSON --out DIR) for each task of `tasks`
    (task -> bnrewrite run's options, e.g. ["--workers", "2", "--task-index", "0", "--timeout", "5"];
    None: under plain python) after its delay, on fresh loopback ports; wait at most `deadline` s,
    kill what is left by its own id (`popen`: how a process starts; the tests' zygote.spawn). Exit
    codes, output, seconds."""
    hosts = json.dumps([f"127.0.0.1:{port}" for port in mw.free_ports(2)])
    env = dict(os.environ, PYTHONPATH=ROOT)
    started, start = {}, time.monotonic()
    try:
        for task, options in sorted(tasks.items(), key=lambda item: (delays or {}).get(item[0], 0.0)):
            time.sleep(max(0.0, start + (delays or {}).get(task, 0.0) - time.monotonic()))
            head = [sys.executable] if options is None else [sys.executable, "-m", "bnrewrite", "run", *options]
            started[task] = (popen(
                [*head, os.path.abspath(script), "--task", str(task), "--hosts", hosts, "--out", out], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), time.monotonic())
        done = {}
        for task, (process, began) in started.items():
            try:
                output, _ = process.communicate(timeout=max(1.0, start + deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                output = process.communicate()[0] + f"\n(killed after {deadline} s)"
            done[task] = subprocess.CompletedProcess(process.args, process.returncode, output)
            done[task].seconds = time.monotonic() - began
        return done
    finally:
        for process, _ in started.values():
            if process.poll() is None:
                process.kill()
            process.wait()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", type=int, required=True)
    parser.add_argument("--hosts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    import tensorflow as tf

    hosts = json.loads(args.hosts)
    config = mw.server_config(args.task, SPEC.towers // len(hosts))
    server = tf.distribute.Server(tf.train.ClusterSpec({"worker": hosts}), job_name="worker", task_index=args.task,
                                  config=config, start=True)
    built = mw.build_worker(SPEC, args.task, len(hosts), timeout_seconds=0.0)
    local = SPEC.towers // len(hosts)
    losses = []
    with built.graph.as_default(), tf.compat.v1.Session(server.target, config=config) as sess:
        sess.run(built.init)
        for step, (images, labels) in enumerate(tm.make_batches(SPEC, args.steps)):
            feed = {}
            for k, (image, label) in enumerate(built.inputs):
                rows = slice((args.task * local + k) * SPEC.batch, (args.task * local + k + 1) * SPEC.batch)
                feed[image], feed[label] = images[rows], labels[rows]
            losses.append(sess.run([built.train_op, built.loss], feed)[1])
            print(f"worker {args.task}: step {step} loss {losses[-1]:.6f}", flush=True)
        values = sess.run(dict(built.variables))
    np.savez(os.path.join(args.out, f"worker{args.task}.npz"), losses=np.asarray(losses), **values)
    sys.stdout.flush()
    os._exit(0)  # a tf.distribute.Server cannot be stopped: skip the interpreter's teardown


if __name__ == "__main__":
    main()
