"""Pack: solved replica counts and partition layouts onto concrete nodes, GPUs and MIG start slices.

Per pool: whole-GPU TP groups go first, largest first, each to an aligned
run of free GPUs in one node. With power-of-two group sizes that divide the
node size this never fails when the MILP's inventory row holds (every free
count stays a multiple of the group being placed). Partitioned GPUs (MIG layouts,
AMD partition modes) then take the remaining free GPUs; their instances get
start slices from ``hetsched.partition.mig.place``. Replicas of models that ask
for spread go to the node holding the fewest of them.

Each node of a MIG pool gets a mig-parted config for the NVIDIA MIG manager,
and each node of a partitioned AMD pool a Device Config Manager profile: its GPUs'
partition modes in index order (whole GPUs unpartitioned). Both are named by
content, so equal nodes share one.

Packing places replicas one by one over every node of a pool, so a large fleet packs for far longer than it
solves: past a deadline it stops between two replicas (DeadlineError).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import groupby

from hetsched.optimizer.build import Option, Pool, Problem
from hetsched.optimizer.deadline import Deadline
from hetsched.optimizer.plan import GpuMode, GpuPlan, NodePlan, PartitionInstance, ReplicaPlacement
from hetsched.optimizer.solve import Solution
from hetsched.optimizer.spec import Role
from hetsched.partition.mig import larger_first, place
from hetsched.partition.naming import ALL_DISABLED, amd_mode_parts, config_name
from hetsched.partition.types import MigDeviceGroup, PartitionGroup


@dataclass(frozen=True)
class Packing:
    nodes: tuple[NodePlan, ...]
    mig_configs: dict[str, list[MigDeviceGroup]]
    partition_profiles: dict[str, list[PartitionGroup]]
    problems: tuple[str, ...]


@dataclass
class _Gpu:
    index: int
    mode: GpuMode = GpuMode.IDLE
    model: str | None = None
    role: Role | None = None
    layout: str | None = None
    partition: str | None = None
    instances: list[PartitionInstance] = field(default_factory=list)


@dataclass
class _Node:
    name: str
    gpus: list[_Gpu]
    replicas: list[ReplicaPlacement] = field(default_factory=list)

    def free_run(self, size: int) -> int | None:
        """Lowest aligned start of ``size`` idle GPUs, or None."""
        for start in range(0, len(self.gpus) - size + 1, size):
            if all(g.mode is GpuMode.IDLE for g in self.gpus[start:start + size]):
                return start
        return None

    def count(self, model: str, role: Role) -> int:
        return sum(1 for r in self.replicas if r.model == model and r.role is role)


def pack(problem: Problem, solution: Solution, *, deadline: Deadline | None = None) -> Packing:
    """Concrete nodes for a solution; ``problems`` lists anything that could not be placed as asked.

    Past ``deadline`` it stops between two replicas (DeadlineError)."""
    spread = {m.name for m in problem.models if m.spread}
    nodes: list[NodePlan] = []
    configs: dict[str, list[MigDeviceGroup]] = {}
    profiles: dict[str, list[PartitionGroup]] = {}
    problems: list[str] = []
    for pool in problem.pools:
        chosen = [(problem.options[i], n) for i, n in sorted(solution.replicas.items()) if problem.options[i].pool == pool.name]
        if not chosen and not solution.layouts.get(pool.name):
            continue
        pool_nodes = [_Node(f"{pool.name}-{k}", [_Gpu(g) for g in range(pool.gpus_per_node)]) for k in range(pool.nodes)]
        problems += _place_whole(pool_nodes, [(o, n) for o, n in chosen if o.whole], spread, deadline)
        problems += _place_partitioned(pool, pool_nodes, solution.layouts.get(pool.name, {}),
                                       [(o, n) for o, n in chosen if not o.whole], spread, deadline)
        for node in pool_nodes:
            if not any(g.mode is not GpuMode.IDLE for g in node.gpus):
                continue
            config = _mig_config(pool, node) if pool.splittable and pool.accelerator.mig is not None else None
            if config is not None:
                name, groups = config
                configs[name] = groups
            profile = _partition_profile(pool, node) if pool.splittable and pool.accelerator.amd_partitions else None
            if profile is not None:
                profiles[profile[0]] = profile[1]
                if len({(g.compute, g.memory) for g in profile[1]}) > 1:
                    problems.append(f"node {node.name} mixes AMD partition modes "
                                    f"({', '.join(sorted({f'{g.compute}/{g.memory}' for g in profile[1]}))}): the "
                                    "Device Config Manager applies such a profile, but AMD does not support it")
            nodes.append(NodePlan(
                name=node.name, pool=pool.name, accelerator=pool.accelerator.id,
                gpus=[GpuPlan(index=g.index, mode=g.mode, model=g.model, role=g.role,
                              partition=g.partition,
                              instances=g.instances) for g in node.gpus],
                replicas=node.replicas, mig_config=config[0] if config else None,
                partition_profile=profile[0] if profile else None))
    return Packing(tuple(nodes), configs, profiles, tuple(problems))


def _place_whole(nodes: list[_Node], chosen: list[tuple[Option, int]], spread: set[str],
                 deadline: Deadline | None) -> list[str]:
    problems = []
    groups = sorted(((o, k) for o, n in chosen for k in range(n)), key=lambda ok: (-ok[0].tp, ok[0].model not in spread))
    for option, _ in groups:
        if deadline is not None:
            deadline.check("packing replicas onto nodes")
        fitting = [(node, start) for node in nodes if (start := node.free_run(option.tp)) is not None]
        if not fitting:
            problems.append(f"no node of pool {option.pool} has {option.tp} free GPUs for a {option.model} replica")
            continue
        if option.model in spread:
            node, start = min(fitting, key=lambda ns: ns[0].count(option.model, option.role))
        else:
            node, start = min(fitting, key=lambda ns: sum(g.mode is GpuMode.IDLE for g in ns[0].gpus))
        for gpu in node.gpus[start:start + option.tp]:
            gpu.mode, gpu.model, gpu.role = GpuMode.WHOLE, option.model, option.role
        node.replicas.append(ReplicaPlacement(model=option.model, role=option.role, device=option.device, tp=option.tp,
                                              gpus=list(range(start, start + option.tp))))
    return problems


def _place_partitioned(pool: Pool, nodes: list[_Node], layouts: Mapping[str, int],
                       chosen: list[tuple[Option, int]], spread: set[str], deadline: Deadline | None) -> list[str]:
    problems = []

    def fill_order(node: _Node) -> tuple[bool, int]:
        """Fullest nodes first; AMD partitions first on nodes without whole-GPU replicas, which keeps a node's
        partition profile uniform (the only kind AMD supports)."""
        whole = pool.accelerator.mig is None and any(g.mode is GpuMode.WHOLE for g in node.gpus)
        return whole, sum(g.mode is GpuMode.IDLE for g in node.gpus)

    free = [(node, gpu) for node in sorted(nodes, key=fill_order) for gpu in node.gpus if gpu.mode is GpuMode.IDLE]
    by_key = {layout.key: layout for layout in pool.layouts}
    slots: dict[str, list[tuple[_Node, _Gpu, int]]] = defaultdict(list)
    wanted = [key for key, n in sorted(layouts.items()) for _ in range(n)]
    if len(wanted) > len(free):
        problems.append(f"pool {pool.name}: {len(wanted)} split GPUs planned, {len(free)} GPUs free")
    for key, (node, gpu) in zip(wanted, free):
        if deadline is not None:
            deadline.check("packing replicas onto split GPUs")
        layout = by_key[key]
        gpu.layout = key
        if pool.accelerator.mig is not None:
            gpu.mode = GpuMode.MIG
            placed = place(pool.accelerator.mig, layout.counts)
            assert placed is not None, f"{key} came from enumerate_layouts and must be placeable"
            starts = [(p.profile, p.start) for p in placed.placements]
        else:
            gpu.mode = GpuMode.PARTITIONED
            gpu.partition = next(iter(layout.counts))
            starts = [(profile, i) for profile, n in layout.counts.items() for i in range(n)]
        gpu.instances = [PartitionInstance(profile=profile, start=start)
                         for profile, start in sorted(starts, key=lambda ps: ps[1])]
        for profile, start in starts:
            slots[profile].append((node, gpu, start))
    replicas = sorted(((o, k) for o, n in chosen for k in range(n)), key=lambda ok: ok[0].model not in spread)
    for option, _ in replicas:
        if deadline is not None:
            deadline.check("packing replicas onto split GPUs")
        candidates = slots.get(option.profile or "", [])
        if not candidates:
            problems.append(f"no free {option.profile} instance in pool {pool.name} for a {option.model} replica")
            continue
        index = (min(range(len(candidates)), key=lambda j: candidates[j][0].count(option.model, option.role))
                 if option.model in spread else 0)
        node, gpu, start = candidates.pop(index)
        gpu.instances = [PartitionInstance(profile=i.profile, start=i.start, model=option.model, role=option.role)
                         if i.start == start and i.model is None and i.profile == option.profile else i
                         for i in gpu.instances]
        node.replicas.append(ReplicaPlacement(model=option.model, role=option.role, device=option.device, tp=1,
                                              gpus=[gpu.index], instance_start=start))
    return problems


def _mig_config(pool: Pool, node: _Node) -> tuple[str, list[MigDeviceGroup]]:
    """The node's mig-parted config: GPUs grouped by layout, named by content so equal nodes share it."""
    by_layout: dict[str | None, list[int]] = defaultdict(list)
    for gpu in node.gpus:
        by_layout[gpu.layout if gpu.mode is GpuMode.MIG else None].append(gpu.index)
    if list(by_layout) == [None]:
        return ALL_DISABLED, [MigDeviceGroup(devices=by_layout[None], mig_enabled=False)]
    groups = []
    for key, devices in sorted(by_layout.items(), key=lambda kv: kv[1][0]):
        instances = next(g for g in node.gpus if g.index == devices[0]).instances if key else []
        counts = dict(sorted(Counter(i.profile for i in instances).items(), key=lambda kv: larger_first(kv[0])))
        groups.append(MigDeviceGroup(devices=devices, mig_enabled=key is not None, mig_devices=counts))
    return config_name(pool.accelerator.id, groups), groups


def _partition_profile(pool: Pool, node: _Node) -> tuple[str, list[PartitionGroup]]:
    """The node's Device Config Manager profile: runs of GPUs in one partition mode, in GPU index order (the
    order the manager assigns them in). Idle GPUs take the mode of a node whose busy GPUs all share one, so that
    the profile is uniform; otherwise they stay unpartitioned. (The optimizer plans NPS1 modes only, which the
    manager can mix on a node.)"""
    assert pool.accelerator.amd_partitions is not None
    whole = pool.accelerator.amd_partitions.unpartitioned_mode()
    busy = {gpu.partition or whole for gpu in node.gpus if gpu.mode is not GpuMode.IDLE}
    idle = next(iter(busy)) if len(busy) == 1 else whole
    modes = [idle if gpu.mode is GpuMode.IDLE else gpu.partition or whole for gpu in node.gpus]
    groups = []
    for mode, run in groupby(modes):
        compute, memory = amd_mode_parts(mode)
        groups.append(PartitionGroup(compute=compute, memory=memory, gpus=len(list(run))))
    return config_name(pool.accelerator.id, groups), groups

