"""The static side of autoscaling: which replica kinds exist, what they cost and hold, and the bounds.

A :class:`Fleet` is built once from a cluster spec (the optimizer's input):
its options carry per-bucket SLO capacities (given or computed by the SLO
capacity search), and :func:`capacity_for_mix` turns them into the capacity
of one replica for the length mix observed right now.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hetsched.catalog import Catalog
from hetsched.engine_metrics.types import Histogram
from hetsched.errors import InputError
from hetsched.optimizer.build import Bucket, CapacitySource, Problem, build_problem, model_buckets
from hetsched.optimizer.spec import ClusterSpec, Role
from hetsched.specs.wire import OptionKey
from hetsched.specs.workload import SLO, LengthDistribution, LengthKind

MIN_SHARE = 0.01
"""A bucket with a smaller share of the observed mix does not rule out configs that cannot serve it."""


@dataclass(frozen=True)
class BucketShape:
    """One request-size bucket as a box of (input, output) lengths, with its planned share."""

    label: str
    share: float
    inputs: tuple[float, float]
    outputs: tuple[float, float]

    @classmethod
    def of(cls, bucket: Bucket) -> BucketShape:
        return cls(bucket.label, bucket.share, _box(bucket.workload.input_len), _box(bucket.workload.output_len))

    def distance(self, input_tokens: float, output_tokens: float) -> float:
        """Log-space distance of a request size to this box (0 inside)."""
        def gap(x: float, box: tuple[float, float]) -> float:
            lo, hi = box
            if x < lo:
                return math.log(lo / max(x, 1.0))
            return math.log(x / hi) if x > hi else 0.0
        return math.hypot(gap(input_tokens, self.inputs), gap(output_tokens, self.outputs))


def _box(dist: LengthDistribution) -> tuple[float, float]:
    if dist.kind is LengthKind.FIXED:
        assert dist.value is not None, "a fixed length has its value"
        return float(dist.value), float(dist.value)
    return float(dist.min_tokens), float(dist.max_tokens) if dist.max_tokens else math.inf


@dataclass(frozen=True)
class ModelBounds:
    """One model's SLO, replica bounds and buckets."""

    name: str
    slo: SLO
    min_replicas: int
    max_replicas: int | None
    buckets: tuple[BucketShape, ...]


@dataclass(frozen=True)
class ScaleOption:
    """One kind of replica: a model on one accelerator config of one pool."""

    key: OptionKey
    gpus: float
    """Pool GPUs one replica takes (a fraction for a MIG slice)."""
    price_per_hour: float
    """Cost of one replica."""
    capacity: Mapping[str, float]
    """Requests/s one replica holds at the SLO, per bucket label it can serve."""

    @property
    def model(self) -> str:
        return self.key.model

    @property
    def pool(self) -> str:
        return self.key.pool


@dataclass(frozen=True)
class Fleet:
    """Models, replica options and pool sizes: everything the policy needs that does not change per round."""

    models: tuple[ModelBounds, ...]
    options: tuple[ScaleOption, ...]
    pool_gpus: Mapping[str, float]
    problem: Problem
    """The optimizer's problem for full re-solves (demands are replaced by observed ones)."""

    def model(self, name: str) -> ModelBounds:
        return next(m for m in self.models if m.name == name)

    def options_of(self, model: str) -> list[ScaleOption]:
        return [o for o in self.options if o.model == model]


def build_fleet(spec: ClusterSpec, catalog: Catalog, *, max_replicas: Mapping[str, int] | None = None,
                capacity_source: CapacitySource | None = None) -> Fleet:
    """A fleet from a cluster spec; ``max_replicas`` caps models by name."""
    bounds = dict(max_replicas or {})
    unknown = sorted(set(bounds) - {m.name for m in spec.models})
    if unknown:
        raise InputError(f"max_replicas names unknown models {unknown}", field="max_replicas")
    slos: dict[str, SLO] = {}
    for model in spec.models:
        if model.slo is None:
            raise InputError(f"{model.name}: the autoscaler measures attainment against an SLO; give one",
                             field=f"models.{model.name}.slo")
        slos[model.name] = model.slo
        if model.disaggregation is not model.disaggregation.UNIFIED:
            raise InputError(f"{model.name}: the autoscaler scales unified replicas only",
                             field=f"models.{model.name}.disaggregation")
        if model.name in bounds and bounds[model.name] < model.min_replicas:
            raise InputError(f"{model.name}: max_replicas {bounds[model.name]} is below min_replicas "
                             f"{model.min_replicas}", field=f"max_replicas.{model.name}")
    problem = build_problem(spec, catalog, capacity_source=capacity_source)
    pools = {p.name: p for p in problem.pools}
    options = tuple(ScaleOption(key=o.key, gpus=o.gpus, price_per_hour=pools[o.pool].price_per_hour * o.gpus,
                                capacity=dict(o.capacity))
                    for o in problem.options if o.role is Role.UNIFIED)
    models = tuple(ModelBounds(name=m.name, slo=slos[m.name], min_replicas=m.min_replicas, max_replicas=bounds.get(m.name),
                               buckets=tuple(BucketShape.of(b) for b in model_buckets(m))) for m in spec.models)
    return Fleet(models=models, options=options, pool_gpus={p.name: float(p.gpu_limit) for p in problem.pools},
                 problem=problem)


def observed_shares(model: ModelBounds, *, mean_input: float | None, mean_output: float | None,
                    input_hist: Histogram | None = None, output_hist: Histogram | None = None) -> dict[str, float]:
    """Share of each bucket in the observed mix; the planned shares while nothing was observed.

    With length histograms, each (input bin, output bin) cell, weighted by the
    product of the two marginals, goes to its nearest bucket; with means only,
    the mean request size goes to its nearest bucket.
    """
    if len(model.buckets) == 1:
        return {model.buckets[0].label: 1.0}
    inputs = _bins(input_hist) or ([(mean_input, 1.0)] if mean_input else None)
    outputs = _bins(output_hist) or ([(mean_output, 1.0)] if mean_output else None)
    if not inputs or not outputs:
        return {b.label: b.share for b in model.buckets}
    shares = {b.label: 0.0 for b in model.buckets}
    for x, px in inputs:
        for y, py in outputs:
            nearest = min(model.buckets, key=lambda b: b.distance(x, y))
            shares[nearest.label] += px * py
    return {label: s for label, s in shares.items() if s > 0}


def _bins(hist: Histogram | None) -> list[tuple[float, float]] | None:
    """(representative value, probability) per finite-width bin of a length histogram."""
    if hist is None or hist.count <= 0:
        return None
    out = []
    lower, below = 0.0, 0.0
    for le, cum in zip(hist.le, hist.counts):
        n = cum - below
        if n > 0:
            mid = (lower + le) / 2 if not math.isinf(le) else max(lower, 1.0) * 1.5
            out.append((max(mid, 1.0), n / hist.count))
        lower, below = (le if not math.isinf(le) else lower), cum
    return out


def capacity_for_mix(option: ScaleOption, shares: Mapping[str, float]) -> float:
    """Requests/s one replica holds on this mix: a harmonic blend of per-bucket capacities (replica time adds up).

    0 when the option cannot serve a bucket holding at least ``MIN_SHARE`` of the mix.
    """
    total = sum(shares.values())
    if total <= 0:
        return 0.0
    seconds = 0.0
    for label, share in shares.items():
        cap = option.capacity.get(label, 0.0)
        if cap <= 0:
            if share / total >= MIN_SHARE:
                return 0.0
            continue
        seconds += share / total / cap
    return 1.0 / seconds if seconds > 0 else 0.0
