"""Synchronized batch norm across several workers (between-graph replication).

Starts 2 worker processes on 127.0.0.1, each a ``tf.distribute.Server`` of one
``ClusterSpec({"worker": [a, b]})`` with 2 virtual CPU devices. Each worker
builds the same 2-tower training graph on its own devices
(``/job:worker/replica:0/task:{i}/device:CPU:{k}``) with its own copy of the
variables (same constant initial values everywhere). The towers' gradients are
averaged locally and then across workers by a ``CollectiveReduceV2`` (merge Add,
final Div), as MultiWorkerMirroredStrategy does, so every worker applies the
same update. bnrewrite then rewrites each worker's graph with
``rewrite_graph(..., backend="collective", num_workers=2, task_index=i)``: every
batch-norm layer normalizes with the moments of all 4 towers of both workers.

The script trains the rewritten graphs (and, for contrast, the un-rewritten
ones) for a few steps and compares them with one device fed all 4*B examples:

    python examples/multi_worker.py [--steps 5] [--batch 4]

What the collective runtime needs (TF 2.x, gRPC, graph mode): the collective
group leader (``experimental.collective_group_leader``) in the *server's*
config (its collective executor is built from it) and in the session's; each
worker's devices are created by its server, so ``device_count`` belongs in the
server config; ``device_filters`` keep each worker's session to its own task,
as MultiWorkerMirroredStrategy sets them. Nothing else (no
``collective_nccl``, which is for GPUs, nor ``share_cluster_devices_in_session``).

Failure modes: a peer that never joins or stops answering makes the others'
collectives fail with DeadlineExceeded after ``timeout_seconds``; a peer that
dies mid-run makes them fail at once with Unavailable. One case TF itself does
not bound: while the *leader* (task 0) is unreachable, the other workers' first
``Session.run`` retries fetching its step-id sequence forever (master_session.cc,
NewStepId), ignoring every timeout. So non-leaders first wait (bounded) until
the leader's port answers and otherwise fail with DeadlineExceeded themselves.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import re
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (HERE, ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import numpy as np  # noqa: E402

#: Keys of this script's own all-reduces (gradients, loss); bnrewrite's are 0x5B00.. / 0x5B0000..
GRAD_GROUP_KEY = 0x6A00
GRAD_INSTANCE_KEY = 0x6A0000
LEADER = "/job:worker/replica:0/task:0"
MODES = ("synced", "unsynced")


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def task_device(task_index: int) -> str:
    return f"/job:worker/replica:0/task:{task_index}"


def server_config(task_index: int, devices: int):
    """ConfigProto for a worker's server and its sessions."""
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(
        device_count={"CPU": devices},
        allow_soft_placement=False,
        intra_op_parallelism_threads=1,
        inter_op_parallelism_threads=2,
    )
    config.experimental.collective_group_leader = LEADER
    config.device_filters.append(f"/job:worker/task:{task_index}")
    return config


def build_worker(spec, task_index: int, num_workers: int, *, timeout_seconds: float, key_offset: int = 0):
    """Worker `task_index`'s graph: spec.towers // num_workers towers on its own CPU devices.

    `spec` describes the global job (spec.towers towers in all, spec.batch examples each);
    the model, initial values and node names are those of examples/towers_model.py.
    Gradients and the loss are averaged over the local towers, then over the workers with
    CollectiveReduceV2 (group GRAD_GROUP_KEY + key_offset).
    """
    import tensorflow as tf

    import towers_model as tm

    if spec.towers % num_workers or spec.device != "cpu":
        raise ValueError(f"{spec.towers} towers do not split over {num_workers} CPU workers")
    local = spec.towers // num_workers
    init_values = tm.initial_values(spec)
    group_key = GRAD_GROUP_KEY + key_offset
    instance_base = GRAD_INSTANCE_KEY + key_offset * 0x1000

    def across_workers(x, j):
        if num_workers == 1:
            return x
        return tf.raw_ops.CollectiveReduceV2(
            input=x, group_size=num_workers, group_key=group_key, instance_key=instance_base + j,
            ordering_token=[], merge_op="Add", final_op="Div", communication_hint="auto",
            timeout_seconds=float(timeout_seconds), name=f"across_workers_{j}")

    graph = tf.Graph()
    with graph.as_default(), tf.device(task_device(task_index)):
        if spec.layer in tm.COND_LAYERS:
            tf.compat.v1.placeholder_with_default(True, [], name=tm.IS_TRAINING_NAME)
        opt = tf.compat.v1.train.MomentumOptimizer(tm.LEARNING_RATE, tm.OPTIMIZER_MOMENTUM)
        inputs, tower_losses, tower_grads = [], [], []
        for k in range(local):
            with tf.device(f"/device:CPU:{k}"), tf.name_scope(f"tower_{k}"):
                images = tf.compat.v1.placeholder(tf.float32, tm.image_shape(spec, spec.batch), name="images")
                labels = tf.compat.v1.placeholder(tf.int32, [spec.batch], name="labels")
                logits = tm._logits(images, spec, init_values)  # the shared model definition
                xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
                loss_k = tf.reduce_mean(xent, name="loss")
                tower_grads.append(opt.compute_gradients(loss_k))
            inputs.append((images.name, labels.name))
            tower_losses.append(loss_k)

        with tf.device("/device:CPU:0"), tf.name_scope("average"):
            avg_grads = []
            for j, per_var in enumerate(zip(*tower_grads)):
                grads = [g for g, _ in per_var]
                local_mean = tf.math.truediv(tf.add_n(grads), float(local))
                avg_grads.append((across_workers(local_mean, j), per_var[0][1]))
            loss = across_workers(tf.math.truediv(tf.add_n(tower_losses), float(local)), len(avg_grads))
        loss = tf.identity(loss, name=tm.LOSS_NAME)
        apply_op = opt.apply_gradients(avg_grads, name="apply_gradients")
        update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
        train_op = tf.group(apply_op, *update_ops, name=tm.TRAIN_OP_NAME)
        init = tf.compat.v1.global_variables_initializer()
        variables = {}
        with tf.name_scope("readout"):
            for v in tf.compat.v1.global_variables():
                variables[v.op.name] = v.value().name
    return tm.Built(graph=graph, train_op=train_op.name, loss=loss.name, inputs=inputs,
                    init=init.name, variables=variables)


def wait_for_leader(address: str, seconds: float) -> None:
    """Block until the leader's gRPC port accepts connections; DeadlineExceeded after `seconds`.

    Needed because TF retries the leader's step-id sequence forever (see the module docstring).
    """
    import tensorflow as tf

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise tf.errors.DeadlineExceededError(
                    None, None,
                    f"collective group leader {LEADER} at {address} did not come up within {seconds:g} s "
                    f"({exc}); start worker 0 (or check the cluster spec)") from None
            time.sleep(0.2)


def run_worker(task_index: int, hosts: list, spec, steps: int, modes, *, timeout_seconds: float,
               join_timeout: float, run_timeout: float, crash_after: int | None = None, more: tuple = ()) -> dict:
    """One worker's whole job, in its own process: server, graphs, rewrite, training.

    Returns {mode: {"losses", "variables", "seconds", "report"}}. Raises on any failure.
    crash_after=n makes the process exit abruptly after n steps (to test the others' errors).
    `more`: (label, spec) pairs (as many towers as `spec`) trained after `spec` on the same server,
    each in its own graphs and sessions with its own gradient keys; results under f"{mode} {label}".
    """
    import tensorflow as tf

    import towers_model as tm
    from bnrewrite import rewrite_graph

    tf.get_logger().setLevel("ERROR")
    num_workers = len(hosts)
    local = spec.towers // num_workers
    config = server_config(task_index, local)
    server = tf.distribute.Server(tf.train.ClusterSpec({"worker": list(hosts)}), job_name="worker",
                                  task_index=task_index, config=config, start=True)
    if task_index != 0:
        wait_for_leader(hosts[0], join_timeout)
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(run_timeout * 1000))
    out = {}
    cases = [(mode, spec, mode) for mode in modes] + [(f"{mode} {label}", other, mode) for label, other in more
                                                       for mode in modes]
    for offset, (name, case, mode) in enumerate(cases):
        if mode not in MODES or case.towers != spec.towers:
            raise ValueError(f"unknown mode {mode!r} or {case.towers} towers, not {spec.towers}")
        batches = tm.make_batches(case, steps)
        built = build_worker(case, task_index, num_workers, timeout_seconds=timeout_seconds, key_offset=offset)
        graph, report = built.graph, ""
        if mode == "synced":
            result = rewrite_graph(built.graph, backend="collective", num_workers=num_workers,
                                   task_index=task_index, timeout_seconds=timeout_seconds)
            graph, report = tm.load_graph(result.meta_graph_def), str(result.report.notes)
        start = time.perf_counter()
        losses = []
        with tf.compat.v1.Session(server.target, graph=graph, config=config) as sess:
            sess.run(built.init, options=options)
            train_op = graph.get_operation_by_name(built.train_op)
            loss = graph.get_tensor_by_name(built.loss)
            for step, (images, labels) in enumerate(batches):
                if step == crash_after:
                    os._exit(3)
                feed = {}
                for k, (img, lbl) in enumerate(built.inputs):
                    rows = slice((task_index * local + k) * case.batch, (task_index * local + k + 1) * case.batch)
                    feed[img], feed[lbl] = images[rows], labels[rows]
                _, value = sess.run([train_op, loss], feed_dict=feed, options=options)
                losses.append(float(value))
            values = sess.run(dict(built.variables), options=options)
        out[name] = {"losses": np.asarray(losses), "variables": {k: np.asarray(v) for k, v in values.items()},
                     "seconds": time.perf_counter() - start, "report": report}
    return out


_NOISE = ("Graph execution error", "Detected at node", "Original stack", "The error could be", "From /job",
          "Node:", "Traceback", "During handling")


def _summary(exc: BaseException) -> str:
    """One line for a worker's failure: TF's own cause and the node, without the stack traces."""
    text = str(exc).strip()
    cause = re.search(r"^\s*\(\d+\) [A-Z_]+: (.+)$", text, re.MULTILINE)  # "(0) DEADLINE_EXCEEDED: ..."
    lines = [cause.group(1)] if cause else [line for line in text.splitlines()
             if line.strip() and not line.startswith((" ", "\t")) and not line.startswith(_NOISE)
             and not re.match(r"\d+ (root error\(s\) found|successful operations|derived errors)", line)]
    line = lines[0] if lines else (text.splitlines()[0] if text else "")
    node = re.search(r"\{\{node ([^}]+)\}\}", text)
    return f"{line} [node {node.group(1)}]" if node else line


def _worker_entry(task_index, hosts, spec, steps, modes, kwargs, results) -> None:
    """Process target: run_worker, report to `results`, and leave without TF's teardown."""
    try:
        message = ("ok", task_index, run_worker(task_index, hosts, spec, steps, modes, **kwargs))
    except BaseException as exc:  # report everything; the parent decides
        message = ("error", task_index, (type(exc).__name__, _summary(exc), traceback.format_exc()))
    try:
        results.put(message)
        results.close()
        results.join_thread()
    finally:
        # A tf.distribute.Server cannot be stopped; skip interpreter teardown (gRPC threads).
        os._exit(0 if message[0] == "ok" else 1)


class WorkerError(RuntimeError):
    """A worker failed; `errors` maps task index -> (exception type name, first line, traceback)."""

    def __init__(self, errors: dict, seconds: float):
        self.errors, self.seconds = errors, seconds
        lines = [f"worker {t}: {name}: {msg}" for t, (name, msg, _) in sorted(errors.items())]
        super().__init__(f"after {seconds:.1f} s: " + "; ".join(lines))


@dataclass
class Launch:
    results: dict  # task -> {mode: {...}}
    seconds: float
    hosts: list = field(default_factory=list)


def launch(spec, steps: int, modes=MODES, *, num_workers: int = 2, tasks=None, timeout_seconds: float = 30.0,
           join_timeout: float = 30.0, run_timeout: float = 60.0, deadline: float = 180.0,
           crash_after: dict | None = None, more: tuple = ()) -> Launch:
    """Run workers `tasks` (default: all) of a `num_workers` cluster on 127.0.0.1 in fresh processes.

    crash_after: {task: n} makes those workers die abruptly after n steps. more: run_worker's.

    Every wait is bounded: collectives by `timeout_seconds`, each Session.run by `run_timeout`,
    a non-leader's wait for the leader by `join_timeout`, and the whole launch by `deadline`,
    after which the processes are killed. No process outlives this call.
    Raises WorkerError when any worker fails (or the deadline passes).
    """
    tasks = list(range(num_workers)) if tasks is None else list(tasks)
    hosts = [f"127.0.0.1:{p}" for p in free_ports(num_workers)]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    kwargs = dict(timeout_seconds=timeout_seconds, join_timeout=join_timeout, run_timeout=run_timeout, more=tuple(more))
    crash_after = crash_after or {}
    procs = {t: ctx.Process(target=_worker_entry,
                            args=(t, hosts, spec, steps, tuple(modes), dict(kwargs, crash_after=crash_after.get(t)),
                                  results),
                            name=f"bnrewrite-worker-{t}", daemon=True) for t in tasks}
    start = time.monotonic()
    done, errors = {}, {}
    try:
        for p in procs.values():
            p.start()
        while len(done) + len(errors) < len(tasks):
            elapsed = time.monotonic() - start
            if elapsed > deadline:
                for t in tasks:
                    if t not in done and t not in errors:
                        errors[t] = ("TimeoutError", f"no result within the launch deadline of {deadline:g} s", "")
                break
            try:
                status, task, payload = results.get(timeout=0.5)
            except queue.Empty:
                for t, p in procs.items():
                    if t not in done and t not in errors and p.exitcode is not None:
                        # exited without a report: wait briefly for a report still in flight
                        try:
                            status, task, payload = results.get(timeout=2.0)
                        except queue.Empty:
                            errors[t] = ("ProcessDied", f"exit code {p.exitcode} without a result", "")
                            continue
                        (done if status == "ok" else errors)[task] = payload
                continue
            (done if status == "ok" else errors)[task] = payload
    finally:
        for p in procs.values():
            p.join(timeout=5.0)
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
        results.cancel_join_thread()
    seconds = time.monotonic() - start
    if errors:
        raise WorkerError(errors, seconds)
    return Launch(results=done, seconds=seconds, hosts=hosts)


def as_result(per_task: dict, mode: str):
    """The job's Result for `mode`: worker 0's (the test checks the workers agree)."""
    import towers_model as tm

    r = per_task[0][mode]
    return tm.Result(losses=np.asarray(r["losses"], np.float64), variables=dict(r["variables"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="examples per tower (B)")
    parser.add_argument("--timeout", type=float, default=60.0, help="collective timeout_seconds")
    args = parser.parse_args(argv)

    import tensorflow as tf

    import towers_model as tm

    tf.get_logger().setLevel("ERROR")
    workers, towers_per_worker = 2, 2
    spec = tm.Spec(towers=workers * towers_per_worker, batch=args.batch)
    print(f"starting {workers} workers x {towers_per_worker} towers x {spec.batch} examples on 127.0.0.1 ...",
          flush=True)
    run = launch(spec, args.steps, MODES, num_workers=workers, timeout_seconds=args.timeout,
                 join_timeout=args.timeout, run_timeout=2 * args.timeout, deadline=10 * args.timeout)
    print(f"cluster {run.hosts}: both workers finished in {run.seconds:.1f} s "
          f"(synced graphs: {run.results[0]['synced']['seconds']:.2f} s / {args.steps} steps)")
    ref_graph = tm.build_reference(spec)
    reference = tm.train(ref_graph.graph, ref_graph, tm.make_batches(spec, args.steps), num_devices=1)
    print()
    print(f"{'graph':<10} {'max rel. error vs 1 device x ' + str(spec.towers * spec.batch):>32} "
          f"{'workers differ by':>18} {'final loss':>11}")
    print(f"{'reference':<10} {'-':>32} {'-':>18} {reference.losses[-1]:>11.6f}")
    for mode in MODES:
        got = as_result(run.results, mode)
        other = as_result({0: run.results[1]}, mode)
        print(f"{mode:<10} {tm.max_rel_error(got, reference):>32.3e} {tm.max_rel_error(other, got):>18.1e} "
              f"{got.losses[-1]:>11.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
