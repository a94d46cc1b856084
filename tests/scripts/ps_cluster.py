"""A parameter-server cluster trainer, written the way replica_device_setter trainers were (issue 40).

Every task is its own process with its own `tf.distribute.Server`: the ps joins and serves;
each worker builds its K towers (one per virtual CPU of its server), trains STEPS steps with
plain SGD and writes what it holds to OUT/worker<I>.npz. Two layouts:

* ps (the TF benchmarks' `parameter_server`): every variable on the ps (`replica_device_setter`),
  moving statistics too; `SyncReplicasOptimizer` averages the workers' gradients and applies them
  once per step, driven by `MonitoredTrainingSession` and its hook (no initial tokens, so no
  worker runs ahead on stale weights).
* replicated (the benchmarks' `distributed_replicated`): each worker computes with its own
  copy of the variables; the ps holds a shadow of each trainable one. A step adds lr/N of the
  worker's gradient to every shadow, meets the other workers at a barrier of FIFO queues on the
  ps (as the benchmarks' `add_sync_queues_and_barrier` does) and copies the shadows back.

`--plain` builds the plain one-device-per-worker script: one tower, no tower scope, its layers at
the graph's top level (conv1, bn1, ...: no `net` scope either), which bnrewrite must take as the
worker's one tower, not as towers of their own.

`--job reference` trains the same model in one process on one device, fed every worker's
examples; `--scale` multiplies its images (the noise floor of a comparison).

`launch` starts such a cluster on localhost (tests/test_ps_cluster.py, tools/ps_reliability.py);
`as_built_here` trains the cluster as built within the caller's process (servers and threads).
`reference` trains the reference in the caller's process (no TensorFlow import of its own).

Usage: ps_cluster.py --job ps|worker|reference --task I --hosts JSON --layout ps|replicated
       [--towers K | --plain] [--workers N] [--batch B] [--steps S] [--out DIR] [--scale F]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1
CLASSES, IMAGE, LR = 3, 6, 0.1
LAYERS = ("conv1", "bn1", "conv2", "bn2", "dense")


def _initial(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A variable's initial value from its name, the same in every process."""
    rng = np.random.RandomState(zlib.crc32(name.encode()))
    return (rng.standard_normal(shape) * 0.5).astype(np.float32)


def _getter(getter, name, shape=None, initializer=None, **kwargs):
    """Name-derived initial values for the model's weights (moving statistics keep theirs)."""
    if "moving_" not in name and shape is not None:
        initializer = tf1.constant_initializer(_initial(name.split("/", 1)[-1] if name.startswith("ps/") else name,
                                                        tuple(shape)))
    return getter(name, shape=shape, initializer=initializer, **kwargs)


def tower_loss(images: tf.Tensor, labels: tf.Tensor, plain: bool = False) -> tf.Tensor:
    """conv - batch norm - relu, twice, global mean, dense: the mean cross-entropy of the tower
    (under variable scope `net`, or at the top level when `plain`)."""
    layers = tf1.layers
    scope = tf1.get_variable_scope() if plain else "net"
    with tf1.variable_scope(scope, reuse=tf1.AUTO_REUSE, custom_getter=_getter):
        h = layers.conv2d(images, 4, 3, padding="same", use_bias=False, name="conv1")
        h = tf.nn.relu(layers.batch_normalization(h, training=True, momentum=0.9, name="bn1"))
        h = layers.conv2d(h, 4, 3, padding="same", use_bias=False, name="conv2")
        h = tf.nn.relu(layers.batch_normalization(h, training=True, momentum=0.9, name="bn2"))
        logits = layers.dense(tf.reduce_mean(h, [1, 2]), CLASSES, name="dense")
    return tf.reduce_mean(tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def batch(step: int, total: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of `step`: `total` examples; worker I's towers take consecutive slices."""
    rng = np.random.RandomState(1000 + step)
    images = rng.standard_normal((total, IMAGE, IMAGE, 3)).astype(np.float32) * 2 + 0.5
    return (images * np.float32(scale)).astype(np.float32), rng.randint(0, CLASSES, total).astype(np.int32)


def model_variables(variables: list[tf.Variable]) -> list[tf.Variable]:
    """The model's (those of LAYERS, in scope `net` or at the top level)."""
    return [v for v in variables if v.op.name.removeprefix("net/").split("/")[0] in LAYERS]


def _towers(args, task: int, device_of) -> tuple[list[tuple[tf.Tensor, tf.Tensor]], tf.Tensor, list]:
    """Per tower (images, labels) placeholders, the worker's mean loss and mean gradients."""
    feeds, losses, grads = [], [], []
    for k in range(args.towers):
        with tf1.device(device_of(k)), contextlib.nullcontext() if args.plain else tf1.name_scope(f"tower_{k}"):
            images = tf1.placeholder(tf.float32, [args.batch, IMAGE, IMAGE, 3], name="images")
            labels = tf1.placeholder(tf.int32, [args.batch], name="labels")
            loss = tower_loss(images, labels, args.plain)
            variables = model_variables(tf1.trainable_variables())
            grads.append(tf.gradients(loss, variables))
            feeds.append((images, labels))
            losses.append(loss)
    mean_grads = [tf.add_n(list(g)) / args.towers for g in zip(*grads)]
    return feeds, tf.add_n(losses) / args.towers, list(zip(mean_grads, variables))


def _feed(feeds, args, task: int, step: int, scale: float = 1.0) -> dict:
    images, labels = batch(step, args.batch * args.towers * args.workers, scale)
    start = task * args.towers * args.batch
    out = {}
    for k, (x, y) in enumerate(feeds):
        lo = start + k * args.batch
        out[x], out[y] = images[lo:lo + args.batch], labels[lo:lo + args.batch]
    return out


def _config(args, task: int, worker: bool) -> tf1.ConfigProto:
    config = tf1.ConfigProto(device_count={"CPU": args.towers}, inter_op_parallelism_threads=2,
                             intra_op_parallelism_threads=1)
    if worker:
        config.device_filters.extend(["/job:ps", f"/job:worker/task:{task}"])
    return config


def _results(session, args, losses: list[float]) -> dict[str, np.ndarray]:
    names = model_variables(tf1.global_variables())
    values = session.run(names)
    out = {v.name.split(":")[0]: value for v, value in zip(names, values)}
    out["losses"] = np.asarray(losses, np.float32)
    return out


def _check_readiness_often() -> None:
    """A non-chief's MonitoredTrainingSession that finds the chief's variables not yet initialized
    looks again 30 s later (SessionManager's recovery_wait_secs, which it does not expose): a
    worker started with the chief slept 30 s of every run. Here it looks every 0.1 s."""
    from tensorflow.python.training import session_manager

    manager = session_manager.SessionManager
    if getattr(manager.__init__, "checks_often", False):
        return
    init = manager.__init__

    @functools.wraps(init)
    def checks_often(self, *args, **kwargs) -> None:
        init(self, *args, **{"recovery_wait_secs": 0.1, **kwargs})

    checks_often.checks_often = True
    manager.__init__ = checks_often


def run_ps_layout(args, server, spec) -> dict[str, np.ndarray]:
    task = args.task
    _check_readiness_often()
    setter = lambda k: tf1.train.replica_device_setter(  # noqa: E731
        worker_device=f"/job:worker/task:{task}/device:CPU:{k}", cluster=spec)
    with tf1.device(setter(0)):
        global_step = tf1.train.get_or_create_global_step()
    feeds, loss, grads_and_vars = _towers(args, task, setter)
    with tf1.device(setter(0)):
        opt = tf1.train.SyncReplicasOptimizer(tf1.train.GradientDescentOptimizer(LR), replicas_to_aggregate=args.workers,
                                              total_num_replicas=args.workers)
        # the updates beside (not before) the apply: what apply_gradients creates (its local step's initializer) must not wait on a batch
        train_op = tf.group(opt.apply_gradients(grads_and_vars, global_step=global_step),
                            *tf1.get_collection(tf1.GraphKeys.UPDATE_OPS))
    hook = opt.make_session_run_hook(task == 0, num_tokens=0)
    losses = []
    with tf1.train.MonitoredTrainingSession(master=server.target, is_chief=task == 0, hooks=[hook],
                                            config=_config(args, task, True), save_checkpoint_secs=None,
                                            save_summaries_steps=None, log_step_count_steps=None, stop_grace_period_secs=2) as session:
        for step in range(args.steps):
            losses.append(session.run([train_op, loss], _feed(feeds, args, task, step))[1])
        return _results(session, args, losses)


def _barrier(name: str, workers: int, task: int, after: list) -> tf.Operation:
    """Every worker passes once all have run `after`: a token to each other worker's queue on the ps,
    then one token from each other worker taken from its own."""
    with tf1.device("/job:ps/task:0"):
        queues = [tf1.FIFOQueue(workers, [tf.bool], shapes=[[]], shared_name=f"{name}_{i}", name=f"{name}_{i}")
                  for i in range(workers)]
    with tf1.control_dependencies(after):
        sent = [queues[i].enqueue(True) for i in range(workers) if i != task]
    with tf1.control_dependencies(sent):
        return queues[task].dequeue_many(workers - 1).op


def run_replicated_layout(args, server, spec) -> dict[str, np.ndarray]:
    task = args.task
    device = lambda k: f"/job:worker/task:{task}/device:CPU:{k}"  # noqa: E731
    feeds, loss, grads_and_vars = _towers(args, task, device)
    with tf1.device("/job:ps/task:0"), tf1.variable_scope("ps", custom_getter=_getter):
        shadows = [tf1.get_variable(v.op.name, v.shape) for _, v in grads_and_vars]
    updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
    with tf1.control_dependencies(updates):
        applied = [s.assign_sub(g * (LR / args.workers)) for (g, _), s in zip(grads_and_vars, shadows)]
    passed = _barrier("bnrewrite_test_step", args.workers, task, applied)
    with tf1.device(device(0)), tf1.control_dependencies([passed]):
        train_op = tf.group(*[v.assign(s.read_value()) for (_, v), s in zip(grads_and_vars, shadows)])
    ready = tf1.report_uninitialized_variables(shadows)
    ready.mark_used()  # polled below; else TensorFlow logs it as never used when its graph goes
    losses = []
    with tf1.Session(server.target, config=_config(args, task, True)) as session:
        session.run(tf1.variables_initializer([v for v in tf1.global_variables() if v not in shadows]))
        if task == 0:
            session.run(tf1.variables_initializer(shadows))
        while len(session.run(ready)):
            time.sleep(0.1)
        for step in range(args.steps):
            losses.append(session.run([train_op, loss], _feed(feeds, args, task, step))[1])
        return _results(session, args, losses)


def run_reference(args) -> dict[str, np.ndarray]:
    """One device fed the examples of every worker's every tower, plain SGD, one update a step."""
    total = args.batch * args.towers * args.workers
    images = tf1.placeholder(tf.float32, [total, IMAGE, IMAGE, 3])
    labels = tf1.placeholder(tf.int32, [total])
    loss = tower_loss(images, labels, args.plain)
    with tf1.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train_op = tf1.train.GradientDescentOptimizer(LR).minimize(loss)
    losses = []
    with tf1.Session(config=tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)) as session:
        session.run(tf1.global_variables_initializer())
        for step in range(args.steps):
            x, y = batch(step, total, args.scale)
            losses.append(session.run([train_op, loss], {images: x, labels: y})[1])
        return _results(session, args, losses)


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch(out: str, layout: str, steps: int, synced: bool, towers: int = 1, tasks=(0, 1),
           timeout: str = "60", deadline: float = 240.0, plain: bool = False, start_timeout: str | None = None,
           gap: float = 0.0, ps_here: bool = False, popen: Callable = subprocess.Popen,
           ) -> dict[int, subprocess.CompletedProcess]:
    """Start a ps running this script (`ps_here`: a server of the caller's process, left idle
    after) and its workers `tasks` of 2 (under `bnrewrite run --workers 2 --timeout T
    [--start-timeout S]` when `synced`; `plain`: the one-tower script without scopes), each `gap` s
    after the one before, wait for the workers (at most `deadline` s), stop every process this
    started by its own id (`popen`: how a process starts; the tests' zygote.spawn); the workers'
    exit codes and output."""
    ps_port, *worker_ports = _free_ports(3)
    hosts = json.dumps({"ps": [f"127.0.0.1:{ps_port}"], "worker": [f"127.0.0.1:{p}" for p in worker_ports]})
    common = ["--hosts", hosts, "--layout", layout, "--steps", str(steps), "--out", out, "--towers", str(towers),
              *(["--plain"] if plain else [])]
    script = os.path.abspath(__file__)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(script))))
    started = []
    if ps_here:
        tf.distribute.Server(tf.train.ClusterSpec(json.loads(hosts)), job_name="ps", task_index=0,
                             config=_config(parse(["--job", "ps", "--towers", str(towers)]), 0, False))
    else:
        started.append(popen([sys.executable, script, "--job", "ps", *common], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    workers = {}
    try:
        for task in tasks:
            if task != tasks[0]:
                time.sleep(gap)
            run = [sys.executable]
            if synced:
                run += ["-m", "bnrewrite", "run", "--workers", "2", "--task-index", str(task), "--timeout", timeout,
                        *(["--start-timeout", start_timeout] if start_timeout else [])]
            workers[task] = popen([*run, script, "--job", "worker", "--task", str(task), *common], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            started.append(workers[task])
        end, done = time.monotonic() + deadline, {}
        for task, process in workers.items():
            try:
                output, _ = process.communicate(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                output, _ = process.communicate()
                output += f"\n(killed after {deadline} s)"
            done[task] = subprocess.CompletedProcess(process.args, process.returncode, output)
        return done
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
            process.wait()


@functools.cache
def _servers_here(cpus: int) -> tuple[tf.train.ClusterSpec, list[tf.distribute.Server]]:
    """A ps and 2 workers (`cpus` CPUs each) as servers of this process, made once: TensorFlow
    cannot stop a server, so every as-built run shares these, each in containers of its own."""
    ports = _free_ports(3)
    spec = tf.train.ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{p}" for p in ports[1:]]})
    args = parse(["--job", "worker", "--towers", str(cpus)])
    return spec, [tf.distribute.Server(spec, job_name=job, task_index=task, config=_config(args, task, job == "worker"))
                  for job, task in (("ps", 0), ("worker", 0), ("worker", 1))]


_runs_here = itertools.count()


def as_built_here(layout: str, steps: int, towers: int = 1, plain: bool = False,
                  deadline: float = 120.0) -> list[dict[str, np.ndarray]]:
    """What `launch(..., synced=False)` has its workers write, without a process: the ps and both
    workers are servers of the caller's process (_servers_here), each worker a thread building
    its own graph whose variables, queues and accumulators live in a container of this run's
    (the cluster as built: no bnrewrite)."""
    spec, servers = _servers_here(2)
    if towers > 2:
        raise ValueError(f"{towers} towers a worker: the servers here have 2 CPUs")
    container = f"asbuilt{next(_runs_here)}"
    args = [parse(["--job", "worker", "--task", str(task), "--layout", layout, "--steps", str(steps),
                   "--towers", str(towers), *(["--plain"] if plain else [])]) for task in (0, 1)]
    run = run_ps_layout if layout == "ps" else run_replicated_layout
    results: list = [None, None]

    def work(task: int) -> None:
        try:
            with tf.Graph().as_default(), tf1.container(container):
                results[task] = run(args[task], servers[1 + task], spec)
        except BaseException as error:  # the caller raises it
            results[task] = error

    threads = [threading.Thread(target=work, args=(task,), daemon=True) for task in (0, 1)]
    for thread in threads:
        thread.start()
    end = time.monotonic() + deadline
    for task, thread in enumerate(threads):
        thread.join(max(0.0, end - time.monotonic()))
        if thread.is_alive() or isinstance(results[task], BaseException):
            raise RuntimeError(f"worker {task} of the as-built cluster: {results[task] or f'not done in {deadline} s'}")
    return results


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", choices=["ps", "worker", "reference"], required=True)
    parser.add_argument("--task", type=int, default=0)
    parser.add_argument("--hosts", default="{}")
    parser.add_argument("--layout", choices=["ps", "replicated"], default="ps")
    parser.add_argument("--towers", type=int, default=1)
    parser.add_argument("--plain", action="store_true", help="one tower, no tower or model scope")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    if args.plain and args.towers != 1:
        parser.error("--plain builds one tower")
    return args


def reference(towers: int, scale: float, plain: bool = False, steps: int = 2) -> dict[str, np.ndarray]:
    """`--job reference` in this process (in a graph of its own): what a test compares a cluster with,
    without a TensorFlow import of its own."""
    args = parse(["--job", "reference", "--towers", str(towers), "--scale", repr(scale), "--steps", str(steps),
                  *(["--plain"] if plain else [])])
    with tf.Graph().as_default():
        return run_reference(args)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    tf1.disable_eager_execution()
    if args.job == "reference":
        np.savez(os.path.join(args.out, f"reference_{args.scale}.npz"), **run_reference(args))
        return 0
    spec = tf.train.ClusterSpec(json.loads(args.hosts))
    server = tf.distribute.Server(spec, job_name=args.job, task_index=args.task,
                                  config=_config(args, args.task, args.job == "worker"), start=True)
    if args.job == "ps":
        server.join()
        return 0
    run = run_ps_layout if args.layout == "ps" else run_replicated_layout
    result = run(args, server, spec)
    np.savez(os.path.join(args.out, f"worker{args.task}.npz"), **result)
    print(f"worker {args.task}: {args.steps} steps, last loss {result['losses'][-1]:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
