"""The all-reduces bnrewrite inserts: NCCL on GPU towers, a local sum on other towers of one
process, TF collectives across workers (and wherever asked for), FIFO queues on a parameter
server across the workers of a ps cluster.

Every all-reduce belongs to a sync group (a set of towers; its `group_key`) and has an
`instance_key` shared by all its members and unique within the graph, so NCCL's
`shared_name` and the collective runtime's keys both identify it.

"local" sums the members' inputs with one AddN on the first member's device, which every
member reads (and gathers their rows with one Pack there: `local_gather`): the graph sees every
tower, so it need not meet them by keys, which costs several times more per all-reduce
(docs/performance.md). What depends on the sum alone is then built once too (`Builder.once`).
It cannot reach into function bodies (control flow v2 branches) or other workers: those need
the rendezvous by keys that NCCL and the collective runtime provide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from tensorflow.core.framework.attr_value_pb2 import AttrValue

from bnrewrite.errors import BackendError
from bnrewrite.graph.index import Device
from bnrewrite.graph.nodes import Builder, DType
from bnrewrite.rewrite.arguments import BACKENDS

#: All-reduce ops that meet their peers by keys, so every tower must launch them in one order
#: (order_collectives); a local sum is an ordinary op and needs none.
COLLECTIVE_OPS = frozenset({"NcclAllReduce", "CollectiveReduceV2"})
#: Attribute on each inserted all-reduce: its instance key, for ordering.
INSTANCE_ATTR = "_bnrewrite_instance"
#: Attribute on each member of a "ps" all-reduce (its sum): the queues' common name, for checks.
QUEUES_ATTR = "_bnrewrite_queues"
#: The [C] vectors each member gives a local gather ([mean, spread]): its Pack reads 2 per tower.
GATHER_ROWS = 2


@dataclass(frozen=True)
class Collective:
    """Where one all-reduce instance goes: its backend, group and keys."""

    backend: str
    group_size: int
    group_key: int
    instance_key: int
    timeout_seconds: float = 0.0
    hint: str = "auto"
    member: int = 0  # this tower's place in the group over all workers ("ps")
    queue_device: str = ""  # the parameter server holding the group's queues ("ps")
    device: str = ""  # where this member's all-reduce runs, if not on its tower's device (spread_over_cpus)

    @property
    def shared_name(self) -> str:
        return f"bnrewrite_g{self.group_key}_i{self.instance_key}"


def placed(device: Device, gpus: int | None, cpus: int | None) -> Device:
    """Where a tower asked for `device` runs in a session with `gpus` GPUs and `cpus` CPU devices
    (None: not known, as asked): a device the session lacks is soft-placed on its CPU 0."""
    count = gpus if device.type == "GPU" else cpus if device.type == "CPU" else None
    if count is None or (count and device.index < count):
        return device
    return replace(device, type="CPU", index=0)


def spread_over_cpus(devices: list[Device], gpus: int | None, cpus: int | None, num_workers: int) -> tuple[str, ...]:
    """The CPU device each tower's keyed all-reduce runs on when the towers run on one device of
    a session whose devices are known (cpus given): /device:CPU:k for tower k, as the collective
    runtime meets one peer per device (the session layer gives the session that many CPUs:
    Report.cpu_devices). Empty when the towers run on devices of their own (or unknown ones)."""
    real = [placed(d, gpus, cpus) for d in devices]
    if cpus is None or num_workers > 1 or len(set(real)) == len(real):
        return ()
    return tuple(f"/device:CPU:{k}" for k in range(len(devices)))


def choose_backend(
    backend: str, devices: list[Device], num_workers: int = 1, in_functions: str = "", available_gpus: int | None = None,
    servers: tuple[Device, ...] = (), available_cpus: int | None = None,
) -> str:
    """'auto' picks NCCL when every tower runs on a GPU of its own (and one worker), else the local
    sum when the towers are in one process and no synced op is inside a function
    (`in_functions` names one that is), queues on a parameter server when several workers' graphs
    place nodes on `servers` (processes that run no tower), else the collective runtime; checks
    the devices allow it.
    `available_gpus`, `available_cpus` (when known: a live session's) say where the towers really
    run: soft placement runs a tower asked for a device the session lacks (a missing GPU,
    `device_count`) on its CPU 0 (`placed`).

    NcclAllReduce only reaches devices of one process: across workers the collective runtime
    is used, with communication hint "nccl" on GPUs. Both meet one peer per device, so towers
    that run on one device (or name none: scope towers) take the local sum, an ordinary op; inside
    functions, which it cannot reach, the collective runtime on a CPU device per tower when the
    session's devices are known (spread_over_cpus).
    """
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    real = [placed(d, available_gpus, available_cpus) for d in devices]
    on_gpu = all(d.type == "GPU" for d in real)
    distinct = len(set(real)) == len(real)
    spread = bool(spread_over_cpus(devices, available_gpus, available_cpus, num_workers))
    if backend == "auto":
        backend = ("nccl" if on_gpu and distinct and num_workers == 1
                   else "local" if num_workers == 1 and not in_functions
                   else "ps" if num_workers > 1 and servers else "collective")
    if backend == "ps":
        return _check_ps(num_workers, in_functions, servers)
    if backend == "collective" and num_workers > 1 and servers:
        raise BackendError(
            f"the graph places nodes on {servers[0]}, a process that runs no tower (a parameter server): collectives "
            "across workers share one step id on every worker, so the workers' steps would meet on that process under "
            "one id and the first to finish would abort the other's (TensorFlow's 'Cleanup <step id>'); "
            'use backend="ps" (or "auto"), which all-reduces through queues on the parameter server')
    if backend == "local" and num_workers > 1:
        raise BackendError('backend local sums inside one process; with several workers use backend="collective"')
    if backend == "local" and in_functions:
        raise BackendError(
            f"backend local cannot reach {in_functions}, which is inside a function (a control flow v2 branch); "
            'use backend="collective" (or backend="nccl" on GPUs)')
    if backend == "nccl" and not on_gpu:
        others = sorted({_where(d, r) for d, r in zip(devices, real) if r.type != "GPU"})
        raise BackendError(f"backend nccl needs every tower on a GPU, but towers sit on {', '.join(others)}; use backend=\"local\" (or backend=\"collective\" across workers)")
    if backend != "local" and not distinct and not (backend == "collective" and spread):
        raise BackendError(
            f"backend {backend} meets one peer per device, but the towers share a device or name none ("
            + ", ".join(_where(d, r) for d, r in zip(devices, real))
            + '): use backend="local", or place each tower on its own device with tf.device'
        )
    return backend


def _where(asked: Device, real: Device) -> str:
    """A tower's device as asked, and where it runs when soft placement moves it."""
    shown = str(asked) or "(no device)"
    return shown if asked == real else f"{shown} (run on {real}: the session has no such device)"


def _check_ps(num_workers: int, in_functions: str, servers: tuple[Device, ...]) -> str:
    if num_workers == 1:
        raise BackendError('backend ps all-reduces across the workers of a parameter-server cluster; with one worker '
                           'use backend="local" (or "auto")')
    if not servers:
        raise BackendError("backend ps needs a parameter server in the graph, but every node is on this worker's "
                           'own devices: use backend="collective" (or "auto")')
    if in_functions:
        raise BackendError(
            f"backend ps cannot reach {in_functions}, which is inside a function (a control flow v2 branch): build "
            "the graph with tf.compat.v1.disable_control_flow_v2(), or keep the variables on the workers and use "
            'backend="collective"')
    return "ps"


def all_reduce(builder: Builder, name: str, tensor: str, dtype: int, key: Collective) -> str:
    """Sum `tensor` over the sync group; returns the reduced tensor."""
    if key.backend == "local":
        return _local_sum(builder, name, tensor, dtype, key)
    if key.backend == "ps":
        return _through_queues(builder, name, tensor, dtype, key)
    if key.backend == "nccl":
        return builder.node(
            "NcclAllReduce", name, [tensor], T=DType(dtype), reduction="sum",
            num_devices=key.group_size, shared_name=key.shared_name, **{INSTANCE_ATTR: key.instance_key},
        )
    size = builder.const(f"{name}/group_size", key.group_size)
    group = builder.const(f"{name}/group_key", key.group_key)
    instance = builder.const(f"{name}/instance_key", key.instance_key)
    return (builder.on(key.device) if key.device else builder).node(
        "CollectiveReduceV2", name, [tensor, size, group, instance], T=DType(dtype),
        merge_op="Add", final_op="Id", communication_hint=key.hint, timeout_seconds=float(key.timeout_seconds),
        is_stateless=False, Nordering_token=0, max_subdivs_per_device=-1, **{INSTANCE_ATTR: key.instance_key},
    )


def _local_sum(builder: Builder, name: str, tensor: str, dtype: int, key: Collective) -> str:
    """The first member creates the AddN on its device; the others add their input to it. Every
    member gets the AddN itself, so that what is built from it can be shared (`Builder.once`)."""
    total = builder.shared.sums.get(key.shared_name)
    if total is None:
        total = builder.node("AddN", f"{name}/sum", [tensor], T=DType(dtype), N=1, **{INSTANCE_ATTR: key.instance_key})
        builder.shared.sums[key.shared_name] = total
    else:
        node = builder.editor.mutable(total)
        node.input.append(tensor)
        node.attr["N"].i = len(node.input)
    return total


def local_gather(builder: Builder, name: str, vectors: Sequence[str], dtype: int, key: Collective) -> str:
    """The local backend's gather: every member's GATHER_ROWS [C] `vectors`, in member order, as
    the rows of one Pack on the first member's device, which every member reads. The rows are
    those a sum of each member's rows padded into place gives (x + 0 is x), by one node for the
    layer instead of a Pack and a Pad per member and their sum."""
    assert len(vectors) == GATHER_ROWS, vectors
    gather = builder.shared.gathers.get(key.shared_name)
    if gather is None:
        gather = builder.node("Pack", f"{name}/rows", vectors, T=DType(dtype), N=len(vectors), axis=0,
                              **{INSTANCE_ATTR: key.instance_key}), {}
        builder.shared.gathers[key.shared_name] = gather
    pack, members = gather
    members[key.member] = list(vectors)
    node = builder.editor.mutable(pack)
    del node.input[:]
    node.input.extend(vector for member in sorted(members) for vector in members[member])
    node.attr["N"].i = len(node.input)
    return pack


def _through_queues(builder: Builder, name: str, tensor: str, dtype: int, key: Collective) -> str:
    """Send `tensor` to every other member through the queue from this member to it, take every
    other member's value from its queue to this one, and add all of them in member order."""
    server = builder.on(key.queue_device)
    sends, values = [], []
    for other in range(key.group_size):
        if other == key.member:
            values.append(tensor)
            continue
        outbox = _queue(server, f"{name}/to_{other}", f"{key.shared_name}_{key.member}to{other}", dtype)
        sends.append("^" + server.node("QueueEnqueueV2", f"{name}/send_{other}", [outbox, tensor],
                                       Tcomponents=[DType(dtype)], timeout_ms=-1))
        inbox = _queue(server, f"{name}/from_{other}", f"{key.shared_name}_{other}to{key.member}", dtype)
        values.append(server.node("QueueDequeueV2", f"{name}/take_{other}", [inbox],
                                  component_types=[DType(dtype)], timeout_ms=-1))
    return builder.node("AddN", name, values + sends, T=DType(dtype), N=len(values),
                        **{INSTANCE_ATTR: key.instance_key, QUEUES_ATTR: key.shared_name})


def _queue(builder: Builder, name: str, shared_name: str, dtype: int) -> str:
    return builder.node("FIFOQueueV2", name, [], component_types=[DType(dtype)], capacity=-1, shared_name=shared_name,
                        shapes=AttrValue(list=AttrValue.ListValue()))
