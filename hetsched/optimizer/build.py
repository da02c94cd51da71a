"""Build: a cluster spec, the catalog and capacities become a typed placement problem.

The problem lists every *option* (model, role, pool, accelerator config, TP)
with its per-replica SLO capacity for each request-size bucket, the demand
per (model, role, bucket), and per pool its GPUs, price and the partition
layouts (MIG layouts or AMD partition modes) its GPUs may take. Options that
cannot work are dropped here with a reason, so infeasibility can be
explained from them later.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from hetsched.catalog import Accelerator, Catalog, Device
from hetsched.errors import InfeasibleError, InputError, NotFoundError, SpecError
from hetsched.optimizer.spec import BucketSpec, CapacityEntry, ClusterSpec, ModelSpec, OpaqueAccelerator, PoolSpec, Role
from hetsched.partition.layouts import PartitionLayout, partition_layouts, partition_profiles
from hetsched.perf.in_force import NamedCorrection
from hetsched.perf.memory import fit, tp_degrees
from hetsched.sim.roles import kv_cache_bytes, long_prompt_tokens, role_query
from hetsched.specs.dtypes import DType, parse_dtype
from hetsched.specs.hf import parse_hf_config
from hetsched.specs.model import ModelArch
from hetsched.specs.registry import load_model
from hetsched.specs.wire import OptionKey
from hetsched.specs.workload import LengthDistribution, Workload, split_buckets

DEFAULT_MIP_GAP = 0.01
"""The gap target when the spec sets none and the proven optimum is out of reach."""
EXACT_MAX_INTEGER_COLUMNS = 100
"""A MILP of one model, or with at most this many integer columns, is small: HiGHS mostly proves its optimum
in well under a second (the examples: ≤ 0.3 s, one model on 5,000 GPUs: 1.3 s), where a 1 % gap target may
keep a dearer plan; the magnitude of the counts matters too (one model on 10,000 GPUs: not in 10 s)."""


@dataclass(frozen=True)
class Bucket:
    """One request-size bucket of a model: its share of requests and the workload shape inside it."""

    label: str
    share: float
    workload: Workload
    context: int


@dataclass(frozen=True)
class CapacityQuery:
    """One capacity the optimizer needs: a replica of ``model`` on ``device`` × ``tp`` in ``role``."""

    spec: ModelSpec
    arch: ModelArch
    device: Device
    tp: int
    role: Role
    bucket: Bucket
    weight_dtype: DType | None
    correction: NamedCorrection | None = None
    """The step-model correction to search under: the one the source names for the replica (see
    :class:`CorrectingSource`); None: the bare step model."""


class CapacitySource(Protocol):
    """Requests/s one replica sustains at the model's SLO for one bucket; 0 when it cannot."""

    def __call__(self, query: CapacityQuery) -> float: ...


@runtime_checkable
class CorrectingSource(Protocol):
    """A CapacitySource whose step model has corrections in force: it names the one for a query's replica, which
    is asked for under it and recorded with the option (the plan says which correction each capacity used)."""

    def correction(self, query: CapacityQuery) -> NamedCorrection | None: ...


def source_correction(source: CapacitySource, query: CapacityQuery) -> NamedCorrection | None:
    """The correction ``source`` has in force for the query's replica; None for a source without corrections."""
    return source.correction(query) if isinstance(source, CorrectingSource) else None


@dataclass(frozen=True)
class Pool:
    name: str
    accelerator: Accelerator
    price_per_hour: float
    gpus_per_node: int
    nodes: int
    gpu_limit: float
    """GPUs the plan may use: a whole number for a pool; a share in the rounding's per-model sub-problems."""
    layouts: tuple[PartitionLayout, ...]

    @property
    def splittable(self) -> bool:
        return bool(self.layouts)


@dataclass(frozen=True)
class Option:
    """One kind of replica: per-replica capacity per bucket label, > 0 only."""

    model: str
    role: Role
    pool: str
    device: str
    profile: str | None
    tp: int
    gpus: float
    capacity: Mapping[str, float]
    correction: NamedCorrection | None = None
    """The step-model correction the capacities were computed under (None: the bare step model, or rows)."""

    @property
    def key(self) -> OptionKey:
        return OptionKey(self.model, self.pool, self.device, self.tp, self.role)

    @property
    def whole(self) -> bool:
        return self.profile is None


@dataclass(frozen=True)
class Demand:
    model: str
    role: Role
    bucket: str
    rate_rps: float


@dataclass(frozen=True)
class ModelRules:
    name: str
    roles: tuple[Role, ...]
    min_replicas: int
    spread: bool
    demand_rps: float


@dataclass(frozen=True)
class Rejection:
    """Why one (model, pool, device) config was left out."""

    model: str
    pool: str
    device: str
    reason: str
    needed_gb: float | None = None
    offered_gb: float | None = None
    offered_by: str | None = None
    memory: bool = False
    """True when the memory model rules the config out (not just a missing or zero capacity)."""


@dataclass(frozen=True)
class Problem:
    """The typed placement problem ``solve`` works on."""

    pools: tuple[Pool, ...]
    options: tuple[Option, ...]
    demands: tuple[Demand, ...]
    models: tuple[ModelRules, ...]
    headroom: float
    churn_weight: float
    time_limit_s: float
    mip_gap: float
    """The gap target: the spec's, else DEFAULT_MIP_GAP."""
    current: Mapping[OptionKey, int] = field(default_factory=dict)
    rejections: tuple[Rejection, ...] = ()
    exact_first: bool = False
    """The spec sets no gap: a small problem is solved to its proven optimum when HiGHS gets there in time."""
    notes: tuple[str, ...] = ()
    """What the plan should say about its input, e.g. a model whose capacities stand in for its SLO."""

    @property
    def small(self) -> bool:
        """One model, or few integer columns (n[o] per option, y[p,L] per pool layout): exact is often cheap."""
        integers = len(self.options) + sum(len(p.layouts) for p in self.pools)
        return len(self.models) == 1 or integers <= EXACT_MAX_INTEGER_COLUMNS

    def pool(self, name: str) -> Pool:
        return next(p for p in self.pools if p.name == name)

    def demand_rates(self) -> dict[tuple[str, Role, str], float]:
        """Requests/s per (model, role, bucket label)."""
        return {(d.model, d.role, d.bucket): d.rate_rps for d in self.demands}


def build_problem(
    spec: ClusterSpec,
    catalog: Catalog,
    *,
    capacity_source: CapacitySource | None = None,
    current: Mapping[OptionKey, int] | None = None,
) -> Problem:
    """Turn ``spec`` into a Problem; capacities from ``spec.capacities``, else from ``capacity_source``."""
    catalog = spec_catalog(spec, catalog)
    pools = tuple(_pool(p, catalog, f"pools[{i}]") for i, p in enumerate(spec.pools))
    _check_size(pools, spec.solver.max_inventory_gpus)
    _check_references(spec, catalog)
    if capacity_source is not None:
        capacity_source = CapacityMemo(capacity_source)
    buckets_of = {m.name: _buckets(m, f"models[{i}]") for i, m in enumerate(spec.models)}
    table = _capacity_table(spec, catalog, buckets_of, pools)
    archs = {m.name: _arch(m, f"models[{i}]", required=m.name not in table) for i, m in enumerate(spec.models)}
    weight_dtypes = {m.name: parse_dtype(m.quantization, field=f"models[{i}].quantization") if m.quantization
                     else None for i, m in enumerate(spec.models)}
    options: list[Option] = []
    rejections: list[Rejection] = []
    demands: list[Demand] = []
    rules: list[ModelRules] = []
    notes: list[str] = _opaque_notes(spec, catalog) + _check_rows_can_run(spec, catalog, archs, weight_dtypes)
    for i, model in enumerate(spec.models):
        where = f"models[{i}]"
        buckets = buckets_of[model.name]
        weight_dtype = weight_dtypes[model.name]
        in_table = model.name in table
        arch = archs[model.name]
        if not in_table and capacity_source is None:
            raise InputError(f"no capacities for {model.name!r}: give rows in 'capacities' or compute them",
                             field=f"{where}")
        if not in_table and model.slo is None:
            raise InputError(f"computing the capacities of {model.name!r} needs its SLO: give one, or rows in "
                             "'capacities'", field=f"{where}.slo")
        if model.slo is None:
            basis = f" ({model.measured_under})" if model.measured_under else ""
            notes.append(f"{model.name}: no SLO given; the capacity rows are taken to meet the SLO they were "
                         f"measured at{basis}")
        for role in model.roles():
            demands += [Demand(model.name, role, b.label, model.workload.rate_rps * b.share) for b in buckets]
        for pool in pools:
            if not _allowed(model, pool):
                continue
            if not in_table and is_opaque(pool.accelerator):
                rejections.append(Rejection(model.name, pool.name, pool.accelerator.id,
                                            f"{pool.accelerator.id} is an opaque accelerator (no compute or memory "
                                            f"figures): give capacity rows for {model.name} on it"))
                continue
            for device, tps in _configs(model, pool, arch):
                if in_table:
                    found = _from_table(table[model.name].get(device.id, []), model, pool, device, buckets)
                else:
                    assert capacity_source is not None and arch is not None
                    found, rejected = _computed(capacity_source, model, arch, pool, device, tps, buckets, weight_dtype)
                    rejections += rejected
                if arch is not None and Role.PREFILL in model.roles():
                    found = [_within_network(o, arch, device, buckets) if o.role is Role.PREFILL else o
                             for o in found]
                options += found
        if arch is not None:
            explained = {r.pool for r in rejections if r.model == model.name}
            rejections += _memory_rejections(model, arch, [p for p in pools if p.name not in explained], weight_dtype,
                                             options, table=table.get(model.name) if in_table else None)
        rules.append(ModelRules(model.name, model.roles(), model.min_replicas, model.spread_across_nodes,
                                model.workload.rate_rps))
    _check_columns(options, spec)
    gap = spec.solver.mip_gap
    return Problem(
        pools=pools, options=tuple(options), demands=tuple(demands), models=tuple(rules),
        headroom=spec.solver.headroom, churn_weight=spec.solver.churn_weight,
        time_limit_s=spec.solver.time_limit_s, mip_gap=DEFAULT_MIP_GAP if gap is None else gap,
        current=dict(current or {}), rejections=tuple(rejections), exact_first=gap is None, notes=tuple(notes),
    )


def spec_catalog(spec: ClusterSpec, catalog: Catalog) -> Catalog:
    """``catalog`` with the spec's opaque accelerator types; one may not take a catalog id."""
    added = {}
    for i, opaque in enumerate(spec.accelerators):
        if opaque.id in catalog.accelerators:
            raise InputError(f"{opaque.id!r} is a catalog accelerator; name the opaque type otherwise, or drop it "
                             "and let pools use the catalog's", field=f"accelerators[{i}].id")
        added[opaque.id] = _opaque(opaque)
    return replace(catalog, accelerators={**catalog.accelerators, **added}) if added else catalog


def is_opaque(accelerator: Accelerator) -> bool:
    """An accelerator known by its price and capacity rows only: nothing to simulate it with."""
    return not accelerator.tflops


def _opaque(spec: OpaqueAccelerator) -> Accelerator:
    return Accelerator(id=spec.id, name=spec.name or spec.id, vendor=spec.vendor, tflops={}, memory_gb=0.0,
                       memory_tbs=0.0, interconnect_gbs=0.0, price_per_hour=spec.price_per_hour,
                       gpus_per_node=spec.gpus_per_node)


def _opaque_notes(spec: ClusterSpec, catalog: Catalog) -> list[str]:
    """Say which pools hold opaque types, and the catalog id a misspelt name may have meant."""
    known = [a for a in catalog.accelerators if not is_opaque(catalog.accelerators[a])]
    notes = []
    for opaque in spec.accelerators:
        pools = [p.name for p in spec.pools if p.accelerator == opaque.id]
        if not pools:
            continue
        close = difflib.get_close_matches(opaque.id, known, n=1)
        guess = f"; if it is {close[0]}, name that accelerator to have it simulated" if close else ""
        notes.append(f"{opaque.name or opaque.id} is no catalog accelerator: pool(s) {', '.join(pools)} hold it as an "
                     f"opaque type, served by the file's capacity rows only{guess}")
    return notes


def _within_network(option: Option, arch: ModelArch, device: Device, buckets: list[Bucket]) -> Option:
    """A prefill replica ships each prompt's KV cache off its node: no more requests than its network carries.

    The bound per bucket is the GPUs' ``network_gbs`` × TP over the KV bytes of the bucket's median prompt.
    """
    link = device.accelerator.network_gbs * 1e9 * option.tp
    capacity = dict(option.capacity)
    for bucket in buckets:
        if bucket.label in capacity:
            shipped = kv_cache_bytes(arch, long_prompt_tokens(bucket.workload, percentile=50.0))
            capacity[bucket.label] = min(capacity[bucket.label], link / shipped)
    return replace(option, capacity={k: v for k, v in capacity.items() if v > 0})


def _check_columns(options: list[Option], spec: ClusterSpec) -> None:
    """Models × pools × configs × buckets grow the MILP multiplicatively: refuse one too large to hold."""
    columns = sum(1 + len(o.capacity) for o in options)
    if columns > spec.solver.max_variables:
        buckets = sum(len(m.workload.buckets or ()) or 1 for m in spec.models)
        raise InputError(f"models {len(spec.models)}, buckets {buckets}, pools {len(spec.pools)}: {columns:,} MILP "
                         f"columns, more than solver.max_variables ({spec.solver.max_variables:,}); "
                         "plan fewer models, buckets or pools at once, or raise solver.max_variables in the cluster "
                         "file", field="solver.max_variables")


def _check_size(pools: tuple[Pool, ...], cap: int) -> None:
    """Packing lays out every node and GPU of a pool the plan uses: refuse an inventory it could not hold."""
    total = 0
    for i, pool in enumerate(pools):
        total += pool.nodes * pool.gpus_per_node
        if total > cap:
            raise InputError(f"pool {pool.name!r} brings the pools to {total:,} GPUs, more than "
                             f"solver.max_inventory_gpus ({cap:,}); give fewer nodes, or raise "
                             "solver.max_inventory_gpus in the cluster file", field=f"pools[{i}].nodes")


def _check_references(spec: ClusterSpec, catalog: Catalog) -> None:
    """Names that must refer to something: allowed pools and accelerators, capacity rows' models."""
    pool_names = [p.name for p in spec.pools]
    for i, model in enumerate(spec.models):
        for j, name in enumerate(model.allowed_pools or []):
            if name not in pool_names:
                raise _at(NotFoundError("pool", name, pool_names), f"models[{i}].allowed_pools[{j}]")
        for j, name in enumerate(model.allowed_accelerators or []):
            if name not in catalog.accelerators:
                raise _at(NotFoundError("accelerator", name, list(catalog.accelerators)),
                                      f"models[{i}].allowed_accelerators[{j}]")
    model_names = [m.name for m in spec.models]
    for i, entry in enumerate(spec.capacities or []):
        if entry.model not in model_names:
            raise InputError(_unknown_row_model(entry.model, spec.models), field=f"capacities[{i}].model")
        if entry.pool is not None and entry.pool not in pool_names:
            raise _at(NotFoundError("pool", entry.pool, pool_names), f"capacities[{i}].pool")


def _unknown_row_model(name: str, models: list[ModelSpec]) -> str:
    """Why no model entry answers to a capacity row's ``model``. Rows name an entry by its ``name``: a row that
    names what an entry serves (its ``model``, under another name) is told which entry that is, since
    "unknown model" would be wrong about a model that exists."""
    serving = next(((j, m) for j, m in enumerate(models) if m.model == name), None)
    if serving is None:
        return str(NotFoundError("model", name, [m.name for m in models]))
    j, entry = serving
    return (f"no entry of models is named {name!r}: models[{j}] serves {name} under the name {entry.name!r}, and a "
            f"capacity row names its model entry by that name; write {entry.name!r} here, or rename models[{j}]")


def _at(error: NotFoundError, field: str) -> InputError:
    """A not-found error placed at a field path of the cluster file."""
    return InputError(str(error), field=field)


def computed_models(spec: ClusterSpec) -> list[str]:
    """Models with no row in the capacity table: their capacities come from a CapacitySource."""
    listed = {entry.model for entry in spec.capacities or []}
    return [m.name for m in spec.models if m.name not in listed]


class CapacityMemo:
    """One search per (model, device, TP, role, bucket, correction) even when several pools share an accelerator,
    or several plans of one spec (``auto`` models planned both ways) share the memo; and the correction in force
    for a replica asked of the source once, so that every plan of the memo uses the same."""

    def __init__(self, source: CapacitySource) -> None:
        self.source = source
        self.known: dict[tuple[str, str, int, Role, str, int | None], float] = {}
        self.corrections: dict[tuple[str, str, int, str | None], NamedCorrection | None] = {}

    def correction(self, query: CapacityQuery) -> NamedCorrection | None:
        key = (query.arch.name, query.device.id, query.tp, query.spec.attention_backend)
        if key not in self.corrections:
            self.corrections[key] = source_correction(self.source, query)
        return self.corrections[key]

    def __call__(self, query: CapacityQuery) -> float:
        key = (query.spec.name, query.device.id, query.tp, query.role, query.bucket.label,
               query.correction.id if query.correction is not None else None)
        if key not in self.known:
            self.known[key] = self.source(query)
        return self.known[key]


def model_buckets(model: ModelSpec) -> list[Bucket]:
    """The request-size buckets of a model's workload: as given, one from mean lengths, or split from a distribution."""
    workload = model.workload
    if workload.distribution is not None:
        if not workload.input_edges and not workload.output_edges:
            shape = workload.distribution
            return [Bucket("all", 1.0, shape, shape.max_request_tokens)]
        return [Bucket(b.label, b.share, b.workload, b.workload.max_request_tokens)
                for b in split_buckets(workload.distribution, workload.input_edges, workload.output_edges)]
    given = workload.buckets or [BucketSpec(input_tokens=workload.input_tokens or 1,
                                            output_tokens=workload.output_tokens or 1, share=1.0)]
    return [Bucket(b.label, b.share, _fixed(b), b.input_tokens + b.output_tokens) for b in given]


def _fixed(bucket: BucketSpec) -> Workload:
    return Workload(name=bucket.label, input_len=LengthDistribution.fixed(bucket.input_tokens),
                    output_len=LengthDistribution.fixed(bucket.output_tokens))


def _buckets(model: ModelSpec, where: str) -> list[Bucket]:
    try:
        return model_buckets(model)
    except InputError as exc:
        raise InputError(str(exc), field=f"{where}.workload.{exc.field or 'distribution'}") from exc


def _pool(spec: PoolSpec, catalog: Catalog, where: str) -> Pool:
    try:
        accelerator = catalog.get(spec.accelerator)
    except NotFoundError as exc:
        raise InputError(str(exc), field=f"{where}.accelerator") from exc
    gpn = spec.gpus_per_node or accelerator.gpus_per_node
    total = spec.nodes * gpn
    limit = total if spec.max_gpus is None else min(total, spec.max_gpus)
    price = accelerator.price_per_hour if spec.price_per_hour is None else spec.price_per_hour
    layouts = partition_layouts(accelerator) if spec.partition_allowed else ()
    if spec.partition_allowed and not layouts:
        raise InputError(f"{accelerator.id} has neither MIG nor compute partitions", field=f"{where}.partition_allowed")
    return Pool(spec.name, accelerator, price, gpn, spec.nodes, limit, layouts)


def _allowed(model: ModelSpec, pool: Pool) -> bool:
    if model.allowed_pools is not None and pool.name not in model.allowed_pools:
        return False
    return model.allowed_accelerators is None or pool.accelerator.id in model.allowed_accelerators


def _configs(model: ModelSpec, pool: Pool, arch: ModelArch | None) -> list[tuple[Device, list[int]]]:
    """Devices of the pool a replica may use, with the TP degrees to try on each."""
    whole = Device.whole(pool.accelerator)
    tps = [tp for tp in (1, 2, 4, 8, 16) if tp <= min(pool.gpus_per_node, model.max_tp)]
    if arch is not None:
        tps = [tp for tp in tp_degrees(arch, whole) if tp in tps]
    configs = [(whole, tps)]
    if pool.splittable:
        configs += [(Device.of(pool.accelerator, profile), [1]) for profile in partition_profiles(pool.accelerator)]
    return configs


def _capacity_table(spec: ClusterSpec, catalog: Catalog, buckets_of: Mapping[str, list[Bucket]],
                    pools: tuple[Pool, ...]) -> dict[str, dict[str, list[CapacityEntry]]]:
    """Table rows by model and device id, each checked against the catalog, its pool and the model's buckets.

    A row repeating another's model, device, pool, TP, role and bucket is refused: which one holds
    would depend on the order of the file.
    """
    table: dict[str, dict[str, list[CapacityEntry]]] = {}
    devices: dict[str, Device] = {}
    seen: dict[tuple[str, str, str | None, int, Role, str | None], int] = {}
    models = {m.name: m for m in spec.models}
    accelerators = {p.name: p.accelerator.id for p in pools}
    labels = {name: {b.label for b in buckets} for name, buckets in buckets_of.items()}
    for i, entry in enumerate(spec.capacities or []):
        profile = entry.device.partition(":")[2]
        if entry.device not in devices:
            try:
                devices[entry.device] = catalog.device(entry.device)
            except InputError as exc:
                raise InputError(str(exc), field=f"capacities[{i}].device") from exc
        if entry.pool is not None and accelerators[entry.pool] != devices[entry.device].accelerator.id:
            raise InputError(f"pool {entry.pool!r} holds {accelerators[entry.pool]}, not {entry.device}",
                             field=f"capacities[{i}].pool")
        key = (entry.model, entry.device, entry.pool, entry.tp, entry.role, entry.bucket)
        if key in seen:
            raise InputError(f"repeats capacities[{seen[key]}] (same model, device, pool, tp, role and bucket); "
                             "keep one, or name each row's pool", field=f"capacities[{i}]")
        seen[key] = i
        if profile and entry.tp != 1:
            raise InputError(f"a partition serves TP=1 only, got tp={entry.tp}", field=f"capacities[{i}].tp")
        model = models[entry.model]
        if entry.role not in model.roles():
            raise InputError(f"role {entry.role.value} does not apply to {model.name!r} "
                             f"(disaggregation {model.disaggregation.value})", field=f"capacities[{i}].role")
        if entry.bucket is not None and entry.bucket not in labels[model.name]:
            raise InputError(f"unknown bucket {entry.bucket!r}; {model.name} has {sorted(labels[model.name])}",
                             field=f"capacities[{i}].bucket")
        table.setdefault(entry.model, {}).setdefault(entry.device, []).append(entry)
    return table


def _from_table(entries: list[CapacityEntry], model: ModelSpec, pool: Pool, device: Device,
                buckets: list[Bucket]) -> list[Option]:
    """The pool's options from its device's rows: the pool's own rows over rows for every pool, a bucket's
    own row over a row for every bucket, whatever the order of the file."""
    options = []
    keyed: dict[tuple[int, Role], dict[str, float]] = {}
    mine = [e for e in entries if e.pool in (None, pool.name)]
    for entry in sorted(mine, key=lambda e: (e.pool is not None, e.bucket is not None)):
        per_bucket = keyed.setdefault((entry.tp, entry.role), {})
        for bucket in buckets:
            if entry.bucket in (None, bucket.label):
                per_bucket[bucket.label] = entry.requests_per_s
    for (tp, role), capacity in sorted(keyed.items()):
        if tp > pool.gpus_per_node:
            continue
        positive = {label: c for label, c in capacity.items() if c > 0}
        if positive:
            options.append(_option(model, role, pool, device, tp, positive))
    return options


def _computed(source: CapacitySource, model: ModelSpec, arch: ModelArch, pool: Pool, device: Device,
              tps: list[int], buckets: list[Bucket], weight_dtype: DType | None) -> tuple[list[Option], list[Rejection]]:
    options: list[Option] = []
    rejections: list[Rejection] = []
    context = max(b.context for b in buckets)
    fitting = [tp for tp in tps if fit(arch, device, tp=tp, weight_dtype=weight_dtype, context_len=context).fits]
    for role in model.roles():
        if role is Role.PREFILL and model.slo is not None:
            try:  # a KV cache that cannot leave the node within the TTFT target: say so, with the numbers
                for b in buckets:
                    role_query(role, model=arch, device=device, workload=b.workload, slo=model.slo)
            except InfeasibleError as exc:
                rejections.append(Rejection(model.name, pool.name, device.id, str(exc)))
                continue
        # the smallest TP with capacity: a larger group rarely pays for its extra GPUs
        for tp in fitting:
            correction = source_correction(source, CapacityQuery(model, arch, device, tp, role, buckets[0],
                                                                 weight_dtype))
            capacity = {b.label: source(CapacityQuery(model, arch, device, tp, role, b, weight_dtype, correction))
                        for b in buckets}
            positive = {label: c for label, c in capacity.items() if c > 0}
            if positive:
                options.append(_option(model, role, pool, device, tp, positive, correction=correction))
                break
        else:
            if fitting:
                rejections.append(Rejection(model.name, pool.name, device.id,
                                            f"{device.id} cannot meet the SLO of {model.name} ({role.value}) at "
                                            f"TP {', '.join(map(str, fitting))}"))
    return options, rejections


def _check_rows_can_run(spec: ClusterSpec, catalog: Catalog, archs: Mapping[str, ModelArch | None],
                    weight_dtypes: Mapping[str, DType | None]) -> list[str]:
    """Refuse a capacity row for a replica that cannot exist: a TP that does not split the heads, or weights
    larger than the TP group's memory. A row the memory model finds short of room only once activations and
    the runtime's reserve are counted is used as measured, with a note (an engine run with other settings may
    well fit)."""
    notes = []
    for i, entry in enumerate(spec.capacities or []):
        arch = archs.get(entry.model)
        device = catalog.device(entry.device)
        if arch is None or is_opaque(device.accelerator) or entry.tp > device.accelerator.gpus_per_node:
            continue  # a row too wide for the nodes is never used, and its pool's rejection says so
        result = fit(arch, device, tp=entry.tp, weight_dtype=weight_dtypes.get(entry.model), context_len=1)
        if result.fits:
            continue
        if arch.num_heads % entry.tp or result.weights_gb > result.device_gb:
            raise InputError(f"{entry.model} cannot run on {entry.device} at TP {entry.tp}: {result.reason}",
                             field=f"capacities[{i}]")
        notes.append(f"capacities[{i}]: by the memory model {entry.model} does not fit {entry.device} at TP "
                     f"{entry.tp} ({result.reason}); the row is used as measured")
    return notes


def _table_gap(pool: Pool, rows: Mapping[str, list[CapacityEntry]] | None) -> str | None:
    """Why a model's capacity ``rows`` give it no option in ``pool`` although some are for the pool's
    accelerator: None when none are, or when they should have given one."""
    mine = [e for device, entries in (rows or {}).items() if device.partition(":")[0] == pool.accelerator.id
            for e in entries if e.pool in (None, pool.name)]
    reasons = []
    if any(":" in e.device for e in mine) and not pool.splittable:
        reasons.append(f"its rows for {pool.accelerator.id} partitions need a pool that allows partitioning")
    too_wide = sorted({e.tp for e in mine if e.tp > pool.gpus_per_node})
    if too_wide:
        reasons.append(f"its rows at TP {', '.join(map(str, too_wide))} need more GPUs than a node of pool "
                       f"{pool.name!r} holds ({pool.gpus_per_node})")
    if any(e.requests_per_s <= 0 for e in mine):
        reasons.append("some of its rows give 0 requests/s")
    return "; ".join(reasons) or None


def _memory_rejections(model: ModelSpec, arch: ModelArch, pools: list[Pool], weight_dtype: DType | None,
                       options: list[Option], *, table: Mapping[str, list[CapacityEntry]] | None) -> list[Rejection]:
    """For each allowed pool with no option for ``model``: why not, from its capacity rows (``table``, when the
    model's capacities come from one) or the memory model at the pool's largest TP."""
    have = {o.pool for o in options if o.model == model.name}
    rejections = []
    for pool in pools:
        if pool.name in have or not _allowed(model, pool):
            continue
        missing = (_table_gap(pool, table) or f"the capacity table has no row for {model.name} on "
                   f"{pool.accelerator.id}") if table is not None else \
            f"{model.name} cannot meet its SLO on {pool.accelerator.id}"
        if is_opaque(pool.accelerator):
            rejections.append(Rejection(model.name, pool.name, pool.accelerator.id, missing))
            continue
        device = Device.whole(pool.accelerator)
        largest = max([tp for tp in tp_degrees(arch, device) if tp <= min(pool.gpus_per_node, model.max_tp)] or [1])
        result = fit(arch, device, tp=largest, weight_dtype=weight_dtype, context_len=1)
        alone = fit(arch, device, tp=1, weight_dtype=weight_dtype, context_len=1)
        rejections.append(Rejection(model.name, pool.name, device.id, result.reason or missing,
                                    needed_gb=alone.weights_gb + alone.activation_gb + alone.reserve_gb,
                                    offered_gb=result.device_gb * largest, offered_by=f"{device.id} × TP{largest}",
                                    memory=result.reason is not None))
    return rejections


def _option(model: ModelSpec, role: Role, pool: Pool, device: Device, tp: int, capacity: dict[str, float], *,
            correction: NamedCorrection | None = None) -> Option:
    gpus = float(tp) if device.profile is None else device.compute_fraction
    return Option(model.name, role, pool.name, device.id, device.profile, tp, gpus, capacity, correction)


def _arch(model: ModelSpec, where: str, *, required: bool) -> ModelArch | None:
    if model.config is not None:
        try:
            return parse_hf_config(model.config, name=model.name, source=f"{where}.config")
        except SpecError as exc:
            message = str(exc).removeprefix(f"{exc.field}: ")
            raise InputError(message, field=f"{where}.config.{exc.field}" if exc.field else f"{where}.config") from exc
    try:
        return load_model(model.source)
    except NotFoundError as exc:
        if required:
            raise InputError(str(exc), field=f"{where}.model" if model.model else f"{where}.name") from exc
        return None

