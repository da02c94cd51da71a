"""Fit the digital twin to a running engine: its settings from its own pages, its step time from a load test.

A small model on a busy host spends most of each step outside the kernels (scheduling, sampling, the API
server), and its kernels run at whatever share of the host the engine gets. Two numbers capture both: the
engine's fixed time per step, and one factor on every kernel the device's constants predict (exact, since each
cost function scales linearly: :meth:`PerfConstants.scaled`). They are fitted, least squares on log time, to
what clients measured: each request's TPOT at the number of sequences decoding beside it, and the TTFT of the
lowest rate's requests (one prefill step, nothing queued ahead). The engine's block size and KV blocks come
from its ``vllm:cache_config_info``, its longest sequence from ``/v1/models``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import least_squares

from hetsched.catalog.perf import PerfConstants
from hetsched.catalog.types import Device
from hetsched.errors import BackendUnavailableError, InputError
from hetsched.perf.calibrate import TRUSTED_MEDIAN_ERROR, ErrorStats
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.step import StepShape
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import ModelArch

_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class EngineFacts:
    """What a vLLM engine states about itself that the twin must copy."""

    block_size: int
    kv_blocks: int
    max_model_len: int | None


def engine_facts(metrics_text: str, *, max_model_len: int | None, url: str) -> EngineFacts:
    """The block size and KV blocks of ``vllm:cache_config_info`` on the engine's ``/metrics`` page."""
    match = _CACHE_INFO.search(metrics_text)
    if match is None:
        raise BackendUnavailableError(f"{url}/metrics has no vllm:cache_config_info: expected a vLLM engine's "
                                      "metrics page")
    labels = dict(_LABEL.findall(match.group("labels")))
    try:
        return EngineFacts(block_size=int(labels["block_size"]), kv_blocks=int(labels["num_gpu_blocks"]),
                           max_model_len=max_model_len)
    except (KeyError, ValueError) as exc:
        raise BackendUnavailableError(f"{url}/metrics: vllm:cache_config_info lacks a numeric block_size and "
                                      f"num_gpu_blocks ({exc})") from exc


@dataclass(frozen=True)
class ObservedRequest:
    """One request of a load test as its client saw it."""

    rate: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float | None
    decoding_beside: float
    """Mean sequences decoding alongside it (itself included) while it decoded."""


@dataclass(frozen=True)
class StepSample:
    """A step the clients saw: a decode step (from a TPOT) or a prefill step (from a TTFT), and its seconds."""

    phase: str
    shape: StepShape
    seconds: float


def step_samples(requests: Sequence[ObservedRequest]) -> list[StepSample]:
    """Decode steps from every request's TPOT at its decode concurrency; prefill steps from the lowest rate's TTFTs."""
    if not requests:
        raise InputError("no request of the load test streamed a token", field="endpoint")
    lowest = min(r.rate for r in requests)
    samples = []
    for r in requests:
        if r.tpot_s:
            context = r.prompt_tokens + r.output_tokens // 2
            samples.append(StepSample("decode", StepShape.build(decode_contexts=[context] * max(1, round(
                r.decoding_beside))), r.tpot_s))
        if r.rate == lowest and r.ttft_s > 0:
            samples.append(StepSample("prefill", StepShape.build(prefill=[(r.prompt_tokens, 0)]), r.ttft_s))
    return samples


@dataclass(frozen=True)
class TwinFit:
    """The twin's constants (the device's, scaled, with the engine's step overhead) and how well they follow."""

    constants: PerfConstants
    kernel_scale: float
    step_overhead_ms: float
    seq_overhead_us: float
    """Host-side time per sequence in a step: on a small model, what makes a larger batch slower."""
    request_overhead_ms: float
    """Time a request spends in the engine's front end before its first step (HTTP, tokenizing, queueing it)."""
    residuals: dict[str, ErrorStats]

    @property
    def trusted(self) -> bool:
        return all(stats.median_abs <= TRUSTED_MEDIAN_ERROR for stats in self.residuals.values())


def fit_twin(samples: Sequence[StepSample], *, model: ModelArch, device: Device, source: str,
             engine: EngineConfig = EngineConfig(), tp: int = 1) -> TwinFit:
    """Kernel scale and step overhead that make ``model``'s step times on ``device`` follow ``samples``."""
    base = device.accelerator.perf
    if base is None:
        raise InputError(f"{device.id} has no step-model constants to scale", field="accelerator")
    if not samples:
        raise InputError("no step times to fit", field="endpoint")
    kernels = RooflineModel(model, device, tp=tp, engine=replace(engine, step_overhead_ms=0.0),
                            constants=replace(base, seq_overhead_us=0.0))
    kernel_s = np.array([kernels.step_time(s.shape) for s in samples])
    seqs = np.array([s.shape.decode_seqs + s.shape.prefill_seqs for s in samples], dtype=float)
    prefill = np.array([s.phase == "prefill" for s in samples], dtype=float)
    measured = np.log([s.seconds for s in samples])
    # Each phase weighs as much as the other, however many samples it has.
    weights = np.sqrt(np.array([1.0 / sum(t.phase == s.phase for t in samples) for s in samples]))

    def predict(params: np.ndarray) -> np.ndarray:
        scale, overhead_s, seq_s, request_s = params
        return overhead_s + seq_s * seqs + scale * kernel_s + prefill * request_s

    def residual(params: np.ndarray) -> np.ndarray:
        return weights * (np.log(predict(params)) - measured)

    typical = float(np.median(np.exp(measured)))
    # A soft L1 loss: a request held up by something else on the host (a noisy neighbour, a garbage collection)
    # should not drag the engine's constants after it.
    result = least_squares(residual, [1.0, typical / 4, typical / 40, typical / 4],
                           bounds=([1e-2, 0.0, 0.0, 0.0], [1e3, 10.0, 1.0, 10.0]), x_scale="jac", loss="soft_l1",
                           f_scale=0.1)
    scale, overhead_s, seq_s, request_s = (float(v) for v in result.x)
    constants = replace(base.scaled(scale), step_overhead_ms=round(overhead_s * 1e3, 4),
                        seq_overhead_us=round(seq_s * 1e6, 3), source=source)
    predicted = predict(result.x)
    errors = (predicted - np.exp(measured)) / np.exp(measured)
    residuals = {phase: ErrorStats.of(e for s, e in zip(samples, errors, strict=True) if s.phase == phase)
                 for phase in sorted({s.phase for s in samples})}
    return TwinFit(constants=constants, kernel_scale=round(scale, 4), step_overhead_ms=round(overhead_s * 1e3, 4),
                   seq_overhead_us=round(seq_s * 1e6, 3), request_overhead_ms=round(request_s * 1e3, 4),
                   residuals=residuals)
