"""One checked training step of a rewritten graph on this machine's CPU, for `bnrewrite verify`.

Every tower device becomes the CPU of its index (`/device:GPU:3` -> `/device:CPU:3`, job, replica
and task dropped), and the session gets that many virtual CPUs. The step runs what the graph's
training targets are (the ops nothing reads that run a kept moving-average update or a batch
norm's gradient; or those named), fed synthetic inputs: every placeholder the step needs, and
the outputs of queue dequeues and iterators directly. Variables take their initializers' values,
then a checkpoint's where it has them. `bnrewrite.session.stepcheck` builds the checks and judges.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from bnrewrite.errors import BnRewriteError
from bnrewrite.graph.ops import INPUT_PIPELINE_OPS
from bnrewrite.io.model import Entry, one_line
from bnrewrite.rewrite.report import Report
from bnrewrite.session import stepcheck

_VARIABLES = frozenset({"VarHandleOp", "VariableV2", "Variable"})
_DEVICE = re.compile(r"(?:/job:[^/]*)?(?:/replica:\d+)?(?:/task:\d+)?(?:/device:|/)(?:gpu|cpu|GPU|CPU|XLA_GPU|XLA_CPU):(\d+)$")


def on_cpu(entry: Entry) -> tuple[Any, int]:
    """A copy of the entry's GraphDef with every device on the CPU of its index (other devices,
    such as `/device:CPU:*`, cleared for the placer to choose), and how many CPUs that takes."""
    graph_def = type(entry.graph_def)()
    graph_def.CopyFrom(entry.graph_def)
    cpus = 1
    for node in graph_def.node:
        match = _DEVICE.fullmatch(node.device)
        node.device = f"/device:CPU:{match[1]}" if match else ""
        cpus = max(cpus, int(match[1]) + 1) if match else cpus
    return graph_def, cpus


def run_step(entry: Entry, report: Report, checkpoint: str | None = None, batch: int | None = None,
             targets: list[str] | None = None) -> stepcheck.Verdict:
    """Build the checks into the rewritten entry, run one step and judge it (PassError if wrong)."""
    import tensorflow as tf

    graph_def, cpus = on_cpu(entry)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    check = stepcheck.build(graph, graph_def, report, python_ops=True)
    ops = _targets(graph, report, targets, check.scope)
    ran = {op.name for op in _upstream(graph, ops)} & {u.node for row in report.layers for u in row.moving}
    fetches = check.fetches(ran)
    needed = _upstream(graph, ops + [graph.get_tensor_by_name(n).op for n in fetches + check.before])
    feed = _feed([op for op in needed if op.outputs and op.outputs[0].name not in check.snapshots], batch)
    config = tf.compat.v1.ConfigProto(device_count={"CPU": cpus}, allow_soft_placement=True,
                                      inter_op_parallelism_threads=2, intra_op_parallelism_threads=1)
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        try:
            _initialize(sess, graph, needed, checkpoint)
            before = sess.run(check.before)
            metadata = tf.compat.v1.RunMetadata()  # its partition graphs tell where the towers ran
            values = sess.run(ops + fetches, {**feed, **check.feed(before)},
                              options=tf.compat.v1.RunOptions(output_partition_graphs=True),
                              run_metadata=metadata)[len(ops):]
            after = sess.run(check.after)
        except tf.errors.OpError as exc:
            raise BnRewriteError(f"the checked step failed in TensorFlow: {one_line(exc.message, 300)}") from None
    verdict = check.evaluate(before, values, after, ran)
    verdict.ran_on = check.ran_on(metadata.partition_graphs)
    return verdict


def _targets(graph: Any, report: Report, names: list[str] | None, scope: str) -> list[Any]:
    """The ops one training step runs: `names`, else the ops nothing but the check (under
    `scope`) reads downstream of a kept moving-average update or a gradient of a synced layer."""
    if names:
        try:
            return [graph.get_operation_by_name(n.split(":")[0]) for n in names]
        except KeyError as exc:
            raise BnRewriteError(f"--step {exc.args[0]}: no such op in the graph; name the train op") from None
    readers: dict[str, list[Any]] = {}
    for op in graph.get_operations():
        for source in [t.op for t in op.inputs] + list(op.control_inputs):
            readers.setdefault(source.name, []).append(op)
    start = [n for row in report.layers for n in (*row.updates_kept, *row.gradients)]
    frontier = [graph.get_operation_by_name(n) for n in start if _has(graph, n)]
    seen = {op.name for op in frontier}
    sinks = []
    while frontier:
        op = frontier.pop()
        after = [r for r in readers.get(op.name, []) if not r.name.startswith(f"{scope}/")]
        if not after:
            sinks.append(op)
        for reader in after:
            if reader.name not in seen:
                seen.add(reader.name)
                frontier.append(reader)
    return sorted(sinks, key=lambda op: op.name)


def _has(graph: Any, name: str) -> bool:
    try:
        graph.get_operation_by_name(name)
    except KeyError:
        return False
    return True


def _upstream(graph: Any, ops: list[Any]) -> list[Any]:
    """Every op the given ones need, stopping at input pipelines (whose outputs are fed)."""
    seen = {op.name: op for op in ops}
    frontier = list(ops)
    while frontier:
        op = frontier.pop()
        if op.type in INPUT_PIPELINE_OPS:
            continue
        for source in [t.op for t in op.inputs] + list(op.control_inputs):
            if source.name not in seen:
                seen[source.name] = source
                frontier.append(source)
    return list(seen.values())


def _feed(needed: list[Any], batch: int | None) -> dict[Any, np.ndarray]:
    """Synthetic values for the placeholders and input-pipeline outputs the step needs: floats
    from a normal distribution (each input its own scale and offset, so towers' statistics
    differ), integers 0 (a valid class), booleans True."""
    rng = np.random.default_rng(0)
    feed = {}
    tensors = [t for op in needed if op.type == "Placeholder" or op.type in INPUT_PIPELINE_OPS for t in op.outputs]
    for k, tensor in enumerate(sorted(tensors, key=lambda t: t.name)):
        shape = _shape(tensor, batch)
        dtype = tensor.dtype.base_dtype
        if dtype.is_floating:
            value = (rng.standard_normal(shape) * (1.0 + 0.5 * k) + k).astype(dtype.as_numpy_dtype)
        elif dtype.is_integer:
            value = np.zeros(shape, dtype.as_numpy_dtype)
        elif dtype.is_bool:
            value = np.ones(shape, bool)
        else:
            raise BnRewriteError(f"input {tensor.name} is of type {dtype.name}, which verify cannot make up; "
                                 "verify feeds numbers and booleans only")
        feed[tensor] = value
    return feed


def _shape(tensor: Any, batch: int | None) -> list[int]:
    """The tensor's static shape, an unknown first dimension made `batch`; BnRewriteError if it
    stays unknown."""
    if tensor.shape.rank is None:
        raise BnRewriteError(f"input {tensor.name} has an unknown shape: verify cannot choose one; "
                             "give the placeholder a shape when building the graph")
    dims = tensor.shape.as_list()
    if dims and dims[0] is None and batch is not None:
        dims[0] = batch
    if None in dims:
        hint = "give --batch B for its batch dimension" if dims[0] is None else "give the placeholder a full shape"
        raise BnRewriteError(f"input {tensor.name} has shape {tensor.shape}: verify cannot choose its unknown "
                             f"dimensions; {hint}")
    return dims


def _initialize(sess: Any, graph: Any, needed: list[Any], checkpoint: str | None) -> None:
    """Every variable the step needs from its initializer (`<variable>/Assign`), then from the
    checkpoint where it holds the variable; BnRewriteError naming one that gets neither."""
    import tensorflow as tf

    variables = [op for op in needed if op.type in _VARIABLES]
    held: dict[str, np.ndarray] = {}
    if checkpoint:
        try:
            reader = tf.train.load_checkpoint(checkpoint)
        except (tf.errors.OpError, ValueError) as exc:
            raise BnRewriteError(f"--checkpoint {checkpoint}: cannot read it ({one_line(str(exc), 200)}); "
                                 "give a checkpoint prefix (the path before .index)") from None
        shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
        for op in variables:  # a checkpoint of another model can hold the same names
            shape, dtype = tf.TensorShape(op.get_attr("shape")), op.get_attr("dtype").base_dtype
            if op.name in shapes and (dtypes[op.name].base_dtype != dtype or not shape.is_compatible_with(shapes[op.name])):
                raise BnRewriteError(
                    f"--checkpoint {checkpoint}: variable {op.name} is {dtypes[op.name].base_dtype.name} of shape "
                    f"{shapes[op.name]} there but {dtype.name} of shape {shape.as_list() if shape.rank is not None else '?'} "
                    "in the model; give the checkpoint this model's Saver wrote")
        held = {op.name: reader.get_tensor(op.name) for op in variables if op.name in shapes}
        if variables and not held:
            raise BnRewriteError(f"--checkpoint {checkpoint} holds none of the step's {len(variables)} variables "
                                 f"(e.g. {variables[0].name}); give the checkpoint this graph's Saver wrote")
    initializers = [f"{op.name}/Assign" for op in variables if _has(graph, f"{op.name}/Assign")]
    lacking = [op.name for op in variables if op.name not in held and not _has(graph, f"{op.name}/Assign")]
    if lacking:
        raise BnRewriteError(f"variable {lacking[0]} has no initializer{' and is not in the checkpoint' if checkpoint else ''} "
                             f"({len(lacking)} such); give --checkpoint PREFIX")
    sess.run(initializers)
    if held:
        with graph.as_default(), tf.name_scope(stepcheck.SCOPE + "/restore/"):
            assigns, feed = [], {}
            for op in variables:
                if op.name in held:
                    value = tf.compat.v1.placeholder(op.get_attr("dtype"), held[op.name].shape)
                    if op.type == "VarHandleOp":
                        assigns.append(tf.raw_ops.AssignVariableOp(resource=op.outputs[0], value=value))
                    else:
                        assigns.append(tf.raw_ops.Assign(ref=op.outputs[0], value=value))
                    feed[value] = held[op.name]
        sess.run(assigns, feed)
