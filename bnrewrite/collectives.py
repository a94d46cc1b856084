"""The all-reduces bnrewrite inserts: NCCL on GPU towers, a local sum on other towers of one
process, TF collectives across workers (and wherever asked for).

Every all-reduce belongs to a sync group (a set of towers; its `group_key`) and has an
`instance_key` shared by all its members and unique within the graph, so NCCL's
`shared_name` and the collective runtime's keys both identify it.

"local" sums the members' inputs with one AddN on the first member's device, which every
member reads through an Identity of its own: the graph sees every tower, so it need not
meet them by keys, which costs several times more per all-reduce (docs/performance.md). It
cannot reach into function bodies (control flow v2 branches) or other workers: those need the
rendezvous by keys that NCCL and the collective runtime provide.
"""

from __future__ import annotations

from dataclasses import dataclass

from bnrewrite.arguments import BACKENDS
from bnrewrite.errors import BackendError
from bnrewrite.graph import Device
from bnrewrite.nodes import Builder, DType

#: All-reduce ops that meet their peers by keys, so every tower must launch them in one order
#: (order_collectives); a local sum is an ordinary op and needs none.
COLLECTIVE_OPS = frozenset({"NcclAllReduce", "CollectiveReduceV2"})
#: Attribute on each inserted all-reduce: its instance key, for ordering.
INSTANCE_ATTR = "_bnrewrite_instance"


@dataclass(frozen=True)
class Collective:
    """Where one all-reduce instance goes: its backend, group and keys."""

    backend: str
    group_size: int
    group_key: int
    instance_key: int
    timeout_seconds: float = 0.0
    hint: str = "auto"

    @property
    def shared_name(self) -> str:
        return f"bnrewrite_g{self.group_key}_i{self.instance_key}"


def choose_backend(
    backend: str, devices: list[Device], num_workers: int = 1, in_functions: str = "", available_gpus: int | None = None,
) -> str:
    """'auto' picks NCCL when every tower is a GPU of its own (and one worker), else the local
    sum when the towers are in one process and no synced op is inside a function
    (`in_functions` names one that is), else the collective runtime; checks the devices allow it.
    `available_gpus` (when known: a live session's) keeps auto off NCCL when a tower's GPU is not
    there, where soft placement runs the towers on the CPU.

    NcclAllReduce only reaches devices of one process: across workers the collective runtime
    is used, with communication hint "nccl" on GPUs. Both meet one peer per device, so towers
    that share a device (or name none: scope towers) can only take the local sum, an
    ordinary op.
    """
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    on_gpu = all(d.type == "GPU" for d in devices)
    present = available_gpus is None or all(0 <= d.index < available_gpus for d in devices)
    distinct = len(set(devices)) == len(devices)
    if backend == "auto":
        backend = ("nccl" if on_gpu and present and distinct and num_workers == 1
                   else "local" if num_workers == 1 and not in_functions else "collective")
    if backend == "local" and num_workers > 1:
        raise BackendError('backend local sums inside one process; with several workers use backend="collective"')
    if backend == "local" and in_functions:
        raise BackendError(
            f"backend local cannot reach {in_functions}, which is inside a function (a control flow v2 branch); "
            'use backend="collective" (or backend="nccl" on GPUs)')
    if backend == "nccl" and not on_gpu:
        others = sorted({str(d) or "(no device)" for d in devices if d.type != "GPU"})
        raise BackendError(f"backend nccl needs every tower on a GPU, but towers sit on {', '.join(others)}; use backend=\"local\" (or backend=\"collective\" across workers)")
    if backend != "local" and not distinct:
        raise BackendError(
            f"backend {backend} meets one peer per device, but the towers share a device or name none ("
            + ", ".join(str(d) or "(no device)" for d in devices)
            + '): use backend="local", or place each tower on its own device with tf.device'
        )
    return backend


def all_reduce(builder: Builder, name: str, tensor: str, dtype: int, key: Collective) -> str:
    """Sum `tensor` over the sync group; returns the reduced tensor."""
    if key.backend == "local":
        return _local_sum(builder, name, tensor, dtype, key)
    if key.backend == "nccl":
        return builder.node(
            "NcclAllReduce", name, [tensor], T=DType(dtype), reduction="sum",
            num_devices=key.group_size, shared_name=key.shared_name, **{INSTANCE_ATTR: key.instance_key},
        )
    size = builder.const(f"{name}/group_size", key.group_size)
    group = builder.const(f"{name}/group_key", key.group_key)
    instance = builder.const(f"{name}/instance_key", key.instance_key)
    return builder.node(
        "CollectiveReduceV2", name, [tensor, size, group, instance], T=DType(dtype),
        merge_op="Add", final_op="Id", communication_hint=key.hint, timeout_seconds=float(key.timeout_seconds),
        is_stateless=False, Nordering_token=0, max_subdivs_per_device=-1, **{INSTANCE_ATTR: key.instance_key},
    )


def _local_sum(builder: Builder, name: str, tensor: str, dtype: int, key: Collective) -> str:
    """The first member creates the AddN on its device; the others add their input to it."""
    total = builder.shared.sums.get(key.shared_name)
    if total is None:
        total = builder.node("AddN", f"{name}/sum", [tensor], T=DType(dtype), N=1)
        builder.shared.sums[key.shared_name] = total
    else:
        node = builder.editor.mutable(total)
        node.input.append(tensor)
        node.attr["N"].i = len(node.input)
    return builder.node("Identity", name, [total], T=DType(dtype), **{INSTANCE_ATTR: key.instance_key})
