"""The ``hetsched autoscale`` file: the cluster to scale, bounds, settings, and where the workers are.

```yaml
cluster: chat.yaml                 # a cluster file (relative to this one) or an inline mapping
max_replicas: {llama-3.1-8b: 12}
autoscale: {interval_s: 5, stable_window_s: 60, scale_down_stabilization_s: 300}
applier:
  kind: local                      # local: simulated workers behind the router; static: decide only
  time_scale: 10                   # local: simulated seconds per wall second
  min_step_wall_s: 0.02            # local: decode steps shorter than this (wall) run several at once
  startup_s: 60                    # local: simulated seconds before a new worker is Ready
  archs: {llama-3.1-8b: llama-3.1-8b}   # local: served name → bundled model the simulator runs
router: {port: 8000}               # local: where the router listens (and optionally its policy)
workers:                           # local: replicas to start with; static: the running endpoints
  - {model: llama-3.1-8b, pool: l40s, device: l40s, replicas: 2}
prometheus: {url: "http://prometheus:9090"}   # optional: read signals here instead of each /metrics
```
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from hetsched.autoscale.fleet import Fleet
from hetsched.engine_metrics.parse import ENGINE_SERIES_QUERY
from hetsched.errors import InputError, invalid_input
from hetsched.optimizer.load import load_cluster, parse_cluster
from hetsched.optimizer.spec import ClusterSpec, Role
from hetsched.router.config import HttpUrl
from hetsched.router.types import Policy
from hetsched.specs.files import read_document
from hetsched.specs.wire import OptionKey


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ApplierKind(StrEnum):
    LOCAL = "local"
    """Start and stop simulated workers in this process, behind the real router."""
    STATIC = "static"
    """Watch a fixed set of endpoints and report decisions without applying them."""


class ApplierConfig(_Strict):
    kind: ApplierKind = ApplierKind.LOCAL
    time_scale: float = Field(1.0, gt=0, description="simulated seconds per wall second (local)")
    startup_s: float = Field(60.0, ge=0, description="simulated seconds before a new worker is Ready (local)")
    drain_s: float = Field(30.0, ge=0, description="simulated seconds a stopped worker keeps serving (local)")
    archs: dict[str, str] = Field(default_factory=dict, description="served model → bundled model (local)")
    max_model_len: StrictInt = Field(8192, ge=16)
    min_step_wall_s: float = Field(0.002, gt=0, description="local: shortest wall time of one engine step; shorter "
                                   "decode steps run several at once and deliver their tokens together")

    def simulated_models(self, spec: ClusterSpec) -> dict[str, str]:
        """Served model name → the bundled model (or config path) its simulated workers run."""
        return {m.name: self.archs.get(m.name, m.source) for m in spec.models}


class WorkerConfig(_Strict):
    model: str
    pool: str
    device: str = Field(description="catalog device id, e.g. l40s or h100-sxm:3g.40gb")
    tp: StrictInt = Field(1, ge=1)
    replicas: StrictInt = Field(1, ge=0, description="local: how many to start with")
    url: HttpUrl | None = Field(None, description="static: the endpoint's base URL")


class RouterListen(_Strict):
    host: str = "127.0.0.1"
    port: StrictInt = Field(8000, ge=0, le=65535, description="0: any free port")
    policy: Policy | None = Field(None, description="local: the router's policy (default: the router's default)")


class PrometheusConfig(_Strict):
    url: HttpUrl
    query: str = ENGINE_SERIES_QUERY
    pod_label: str = "pod"


class AutoscaleFile(_Strict):
    cluster: str | dict[str, Any]
    max_replicas: dict[str, StrictInt] = Field(default_factory=dict)
    autoscale: dict[str, Any] = Field(default_factory=dict)
    applier: ApplierConfig = ApplierConfig()
    router: RouterListen = RouterListen()
    workers: list[WorkerConfig] = Field(default_factory=list)
    prometheus: PrometheusConfig | None = None

    @model_validator(mode="after")
    def _workers_fit_kind(self) -> AutoscaleFile:
        for i, worker in enumerate(self.workers):
            if self.applier.kind is ApplierKind.STATIC and worker.url is None:
                raise ValueError(f"workers[{i}]: a static worker needs its url")
            if self.applier.kind is ApplierKind.LOCAL and worker.url is not None:
                raise ValueError(f"workers[{i}]: local workers are started here and take no url")
        return self


def load_autoscale_file(path: str | Path) -> tuple[AutoscaleFile, ClusterSpec]:
    """The file and the cluster spec it names (a path relative to the file, or inline)."""
    path = Path(path)
    raw = read_document(path, field="--config")
    try:
        config = AutoscaleFile.model_validate(raw)
    except ValidationError as exc:
        raise invalid_input(exc, source=path.name) from exc
    if isinstance(config.cluster, dict):
        spec = parse_cluster(config.cluster, source=f"{path.name}: cluster", base=path.parent)
    else:
        spec = load_cluster(path.parent / config.cluster)
    models = {m.name for m in spec.models}
    pools = {p.name for p in spec.pools}
    for i, worker in enumerate(config.workers):
        if worker.model not in models:
            raise InputError(f"unknown model {worker.model!r}; the cluster has {sorted(models)}",
                             field=f"workers[{i}].model")
        if worker.pool not in pools:
            raise InputError(f"unknown pool {worker.pool!r}; the cluster has {sorted(pools)}", field=f"workers[{i}].pool")
    return config, spec


def worker_options(file: AutoscaleFile, fleet: Fleet) -> list[OptionKey]:
    """The fleet option each worker is a replica of; a worker that is none of the fleet's options, or starting
    replicas beyond a model's ``max_replicas`` or a pool's GPUs, is refused before anything starts."""
    known = {o.key: o for o in fleet.options}
    keys = []
    for i, worker in enumerate(file.workers):
        key = OptionKey(worker.model, worker.pool, worker.device, worker.tp, Role.UNIFIED)
        if key not in known:
            raise InputError(f"{worker.model} on {worker.device} TP={worker.tp} in pool {worker.pool} is not an option "
                             "of the cluster (no capacity, or it does not fit)", field=f"workers[{i}]")
        keys.append(key)
    for model in fleet.models:
        start = sum(w.replicas for w in file.workers if w.model == model.name)
        if model.max_replicas is not None and start > model.max_replicas:
            raise InputError(f"the workers start {start} replicas of {model.name}, more than its max_replicas "
                             f"{model.max_replicas}", field="workers")
    for pool, gpus in fleet.pool_gpus.items():
        used = sum(w.replicas * known[key].gpus for w, key in zip(file.workers, keys, strict=True) if key.pool == pool)
        if used > gpus + 1e-9:
            raise InputError(f"the workers start replicas on {used:g} GPUs of pool {pool}, which has {gpus:g}",
                             field="workers")
    return keys
