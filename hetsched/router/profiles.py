"""Endpoint profiles for the ``slo`` policy: step-latency model, KV capacity and price per replica."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from hetsched.catalog import load_catalog
from hetsched.catalog.host import HostInfo
from hetsched.catalog.perf import PerfConstants
from hetsched.errors import InfeasibleError
from hetsched.perf.memory import fit
from hetsched.perf.roofline import RooflineModel
from hetsched.router.predict import EndpointProfile
from hetsched.router.types import Endpoint
from hetsched.sim.roles import kv_cache_bytes
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import ModelArch
from hetsched.specs.registry import load_model


DEFAULT_MAX_MODEL_LEN = 8192
"""Longest sequence a replica must hold (vLLM's ``--max-model-len``) unless told otherwise."""


@lru_cache(maxsize=256)
def roofline_profile(model: str, device_id: str, tp: int, engine: EngineConfig = EngineConfig(),
                     max_model_len: int = DEFAULT_MAX_MODEL_LEN, host: HostInfo | None = None,
                     perf: tuple[tuple[str, PerfConstants], ...] = ()) -> EndpointProfile:
    """The analytic profile of ``model`` on ``tp`` × ``device_id`` (cached: endpoints share hardware).

    ``host`` is the machine a ``cpu`` device is; without one, ``cpu`` is unknown. ``perf`` holds
    calibrated step-model constants by accelerator id, in place of the catalog's.
    """
    return arch_profile(load_model(model), device_id, tp, engine, max_model_len, host, perf)


def arch_profile(arch: ModelArch, device_id: str, tp: int, engine: EngineConfig = EngineConfig(),
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN, host: HostInfo | None = None,
                 perf: tuple[tuple[str, PerfConstants], ...] = ()) -> EndpointProfile:
    """:func:`roofline_profile` of a model given as its architecture (an inline config has no name to load)."""
    catalog = load_catalog().with_perf(dict(perf)) if perf else load_catalog()
    device = catalog.device(device_id, host=host)
    memory = fit(arch, device, tp=tp, engine=engine, context_len=max_model_len)
    if not memory.fits:
        raise InfeasibleError(f"{arch.name} does not fit {device_id} at TP={tp}: {memory.reason}")
    return EndpointProfile(
        step_model=RooflineModel(arch, device, tp=tp, engine=engine),
        kv_capacity_tokens=memory.max_kv_tokens,
        price_per_hour=device.accelerator.price_per_hour * tp,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        network_gbs=device.accelerator.network_gbs,
        kv_bytes_per_token=kv_cache_bytes(arch, max_model_len) / max_model_len,
    )


def endpoint_profile(endpoint: Endpoint, *, arch: str, engine: EngineConfig = EngineConfig(),
                     max_model_len: int = DEFAULT_MAX_MODEL_LEN, host: HostInfo | None = None,
                     perf: tuple[tuple[str, PerfConstants], ...] = ()) -> EndpointProfile:
    """The profile of one endpoint, with its own price when it sets one."""
    base = roofline_profile(arch, endpoint.accelerator, endpoint.tp, engine, max_model_len, host, perf)
    if endpoint.price_per_hour is None:
        return base
    return replace(base, price_per_hour=endpoint.price_per_hour)
