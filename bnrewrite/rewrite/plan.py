"""The plan every pass follows: towers, layer groups, sync groups, backend and collective keys.

It is computed once from the input graph (matching), so that passes stay small and the
keys of a layer are the same in every pass and on every worker that rewrites the same graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from bnrewrite.errors import (
    BnRewriteError,
    IndependentModelsError,
    NoTowersError,
    NotReplicasError,
    TowerMismatchError,
    UnsyncedLayerError,
)
from bnrewrite.graph.index import Device, Graph
from bnrewrite.match.census import Census, Site, Skip
from bnrewrite.match.live_work import partial_step, trained_alone
from bnrewrite.match.replicas import trained_apart
from bnrewrite.match.towers import LayerGroup, Towers, group_towers, tower_map
from bnrewrite.match.updates import Searched, direct_updates, find_updates
from bnrewrite.rewrite.collectives import Collective, choose_backend, spread_over_cpus
from bnrewrite.rewrite.functions import in_body

#: Instance keys of one layer: 0 is the forward all-reduce, 1.. its gradients.
KEYS_PER_LAYER = 16


@dataclass(frozen=True)
class Options:
    """How to rewrite; the keyword arguments of `rewrite_graph`."""

    backend: str = "auto"
    tower_by: str = "auto"
    group_size: int | None = None
    timeout_seconds: float = 0.0
    num_workers: int = 1
    task_index: int = 0
    available_gpus: int | None = None  # auto: towers on GPUs beyond these take the local sum
    available_cpus: int | None = None  # the session's CPU devices, when known: towers beyond them run on CPU 0
    group_key_base: int = 0x5B00
    instance_key_base: int = 0x5B0000


@dataclass(frozen=True)
class Plan:
    towers: Towers
    backend: str
    sync_groups: tuple[tuple[str, ...], ...]
    options: Options
    servers: tuple[Device, ...] = ()  # backend "ps": the parameter servers, which hold the queues
    spread: tuple[str, ...] = ()  # backend "collective" on towers that run on one device: each tower's CPU

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        return self.towers.groups

    def collective(self, layer: int, phase: int, tower: str) -> Collective:
        """Keys of the all-reduce `phase` (0 forward, j+1 gradient j) of `layer` for `tower`."""
        index = next(i for i, members in enumerate(self.sync_groups) if tower in members)
        members = self.sync_groups[index]
        return Collective(
            backend=self.backend,
            group_size=len(members) * self.options.num_workers,
            group_key=self.options.group_key_base + index,
            instance_key=self.options.instance_key_base + layer * KEYS_PER_LAYER + phase,
            timeout_seconds=self.options.timeout_seconds,
            hint="nccl" if self.options.num_workers > 1 and self.on_gpu else "auto",
            member=self.options.task_index * len(members) + members.index(tower),
            queue_device=str(self.servers[layer % len(self.servers)]) if self.servers else "",
            device=self.spread[self.towers.ids.index(tower)] if self.spread else "",
        )

    def updated_by_worker_0(self, graph: Graph, variable: str) -> bool:
        """Whether `variable` is another worker's to update: this is not worker 0, and the variable
        lives on a parameter server, where every worker's towers update it with the same value."""
        device = graph.device(variable)
        return self.options.task_index > 0 and any((device.job, device.task) == (s.job, s.task) for s in self.servers)

    @property
    def on_gpu(self) -> bool:
        return all(site.device.type == "GPU" for site in self.groups[0].sites)


def make_plan(graph: Graph, census: Census, options: Options) -> Plan:
    _set_aside_one_device_steps(census, options.tower_by)
    searched: Searched = {}  # each site's first searches, made once for both
    direct = {s.name: direct_updates(graph, s.statistics, searched) for s in census.sites}
    reached: dict[str, int] = {}  # update -> how many sites reach it directly
    for updates in direct.values():
        for update in updates:
            reached[update] = reached.get(update, 0) + 1
    sites = [_with_updates(graph, s, lambda update, own=direct[s.name]: reached.get(update, 0) > (update in own),
                           searched) for s in census.sites]  # grouping reads the updated variables
    try:
        towers = group_towers(graph, sites, options.tower_by, min_towers=1 if options.num_workers > 1 else 2)
    except (NoTowersError, TowerMismatchError) as exc:
        if not census.skips:
            raise
        first = census.skips[0]
        raise type(exc)(f"{exc} ({len(census.skips)} batch-norm op(s) skipped, e.g. {first.node}: {first.reason})") from None
    size = options.group_size or len(towers.ids)
    if options.num_workers > 1 and size != len(towers.ids):
        raise BnRewriteError("sync groups within a worker cannot be combined with several workers; drop group_size")
    if options.num_workers > 1 and options.backend == "nccl":
        raise BnRewriteError('NcclAllReduce works inside one process; with several workers use backend="collective"')
    if size * options.num_workers < 2 or len(towers.ids) % size:
        raise BnRewriteError(f"group size {size} must be at least 2 and divide the number of towers ({len(towers.ids)})")
    sync_groups = tuple(towers.ids[i:i + size] for i in range(0, len(towers.ids), size))
    apart = trained_apart(graph, towers, sync_groups) if options.num_workers == 1 else ""
    if apart:  # on one device nothing but names made them towers: separate models, run as they are
        raise (NotReplicasError if options.tower_by == "auto" and towers.by == "scope" else IndependentModelsError)(apart)
    waits = partial_step([[group.sites[towers.ids.index(t)].name for t in members] for group in towers.groups
                          for members in sync_groups], census.steps)
    if waits:
        raise TowerMismatchError(waits)
    devices = [site.device for site in towers.groups[0].sites]
    if options.num_workers > 1:
        _check_task(devices, options.task_index)
    servers = _servers(graph, devices) if options.num_workers > 1 else ()
    inside = next((name for group in towers.groups for site in group.sites for name in (site.name, *site.grads)
                   if in_body(name)), "")
    backend = choose_backend(options.backend, devices, options.num_workers, inside, options.available_gpus, servers,
                             options.available_cpus)
    spread = (spread_over_cpus(devices, options.available_gpus, options.available_cpus, options.num_workers)
              if backend == "collective" else ())
    return Plan(towers, backend, sync_groups, options, servers if backend == "ps" else (), spread)


def _set_aside_one_device_steps(census: Census, tower_by: str) -> None:
    """Take the sites that only steps training one device run out of `census.sites` (into
    `not_run`), so no all-reduce spans a site the step being run does not run; a step that runs
    some of the synchronized towers but not all is refused (TowerMismatchError)."""
    alone, why = trained_alone(tower_map(census.sites, tower_by), census.steps)
    if why:
        raise TowerMismatchError(why)
    if alone:
        idle = {skip.node for skip in alone}
        census.not_run.extend(alone)
        census.sites = [site for site in census.sites if site.name not in idle]


def _check_task(devices: list[Device], task_index: int) -> None:
    """A worker's towers that name their task run on task `task_index`: a worker given another's
    index (two workers with the same one) would take that worker's place in every all-reduce."""
    other = next((d for d in devices if d.task >= 0 and d.task != task_index), None)
    if other is not None:
        raise BnRewriteError(
            f"task_index={task_index} does not fit this worker: its towers run on {other}, task {other.task}; give "
            f"each worker the index of its own task (two workers given task_index={task_index} would both take "
            f"worker {task_index}'s place in every all-reduce and wait for the missing one)")


def _servers(graph: Graph, devices: list[Device]) -> tuple[Device, ...]:
    """The processes (job, replica, task) this worker's graph places nodes on that run none of its
    towers: a cluster's parameter servers, in order."""
    own = {(d.job, d.task) for d in devices}
    found = {(d.job, max(d.replica, 0), d.task) for d in map(graph.device, graph.names())
             if d.job and (d.job, d.task) not in own}
    return tuple(Device(job, replica, task, "CPU", 0) for job, replica, task in sorted(found))


def plan_without_shared_body_updates(graph: Graph, census: Census, options: Options) -> Plan:
    """make_plan, after dropping layers whose moving averages are updated inside branch functions
    on variables the towers share (that would need deduplication inside functions), or whose
    statistics enter functional control flow that bnrewrite does not search for updates."""
    plan = make_plan(graph, census, options)
    doomed: dict[str, str] = {}
    for group in plan.groups:
        writers: dict[str, set[str]] = {}
        for site in group.sites:
            for update in site.updates:
                writers.setdefault(update.variable, set()).add(site.name)
        for site in group.sites:
            for update in site.updates:
                if in_body(update.node) and len(writers[update.variable]) > 1:
                    doomed.update({s.name: (
                        f"its moving average {update.variable} is shared by the towers and updated inside a branch "
                        "function; deduplicating updates inside functions is not supported, so this layer keeps "
                        "per-tower statistics") for s in group.sites})
            if site.opaque:
                doomed.update({s.name: (
                    f"its batch statistics enter {site.opaque[0]} ({graph.node(site.opaque[0]).op}), whose functions "
                    "are not searched for moving-average updates (e.g. tf_keras batch renormalization with a "
                    "training tensor under control flow v2): build the graph with "
                    "tf.compat.v1.disable_control_flow_v2() to have it synchronized") for s in group.sites})
    if not doomed:
        return plan
    census.skips.extend(Skip(name, reason) for name, reason in doomed.items())
    census.sites = [s for s in census.sites if s.name not in doomed]
    if not census.sites:
        raise UnsyncedLayerError(f"no batch-norm layer of the {len(plan.towers.ids)} towers can be synchronized: "
                                 f"{census.skips[-1].node}: {census.skips[-1].reason}")
    return make_plan(graph, census, options)


def _with_updates(graph: Graph, site: Site, elsewhere: Callable[[str], bool], searched: Searched | None = None) -> Site:
    updates, opaque = find_updates(graph, site.statistics, elsewhere, searched)
    return replace(site, updates=updates, opaque=opaque)
