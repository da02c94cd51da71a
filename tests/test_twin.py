"""The twin fitted to an engine: its settings read from the engine's pages, its step time from what clients saw."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from hetsched.catalog import Device, load_catalog
from hetsched.cli import app
from hetsched.errors import BackendUnavailableError, InputError
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.step import StepShape
from hetsched.perf.tail import FrontEnd, Tail
from hetsched.profiler.twin import ObservedRequest, engine_facts, fit_twin, step_samples
from hetsched.simworker import WorkerSpec, start_worker_thread
from hetsched.specs.engine import EngineConfig
from hetsched.specs.registry import load_model

H100 = Device.whole(load_catalog().get("h100-sxm"))
MODEL = load_model("qwen3-0.6b")


def _requests(scale: float, overhead_s: float, request_s: float, rng: np.random.Generator) -> list[ObservedRequest]:
    """Requests as an engine whose kernels run ``scale`` times the model would see them, with a little noise."""
    kernels = RooflineModel(MODEL, H100, engine=EngineConfig(step_overhead_ms=0.0))
    out = []
    for rate, beside in ((1.0, 1.0), (4.0, 3.0), (8.0, 6.0)):
        for prompt in (64, 256, 1024):
            decode = kernels.step_time(StepShape.build(decode_contexts=[prompt + 32] * round(beside)))
            prefill = kernels.step_time(StepShape.build(prefill=[(prompt, 0)]))
            noise = rng.normal(1.0, 0.01, 2)
            out.append(ObservedRequest(rate=rate, prompt_tokens=prompt, output_tokens=64,
                                       ttft_s=(request_s + overhead_s + scale * prefill) * noise[0],
                                       tpot_s=(overhead_s + scale * decode) * noise[1], decoding_beside=beside))
    return out


def test_the_fit_finds_the_engine_behind_the_timings() -> None:
    observed = _requests(3.0, 2e-3, 5e-3, np.random.default_rng(0))
    fit = fit_twin(step_samples(observed), model=MODEL, device=H100, source="test")
    assert fit.kernel_scale == pytest.approx(3.0, rel=0.1)
    assert fit.step_overhead_ms == pytest.approx(2.0, rel=0.2)
    assert fit.request_overhead_ms == pytest.approx(5.0, rel=0.2)
    assert fit.trusted and set(fit.residuals) == {"decode", "prefill"}
    # the twin's constants reproduce the engine's decode step
    twin = RooflineModel(MODEL, H100, constants=fit.constants)
    shape = StepShape.build(decode_contexts=[288] * 3)
    kernels = RooflineModel(MODEL, H100, engine=EngineConfig(step_overhead_ms=0.0))
    assert twin.step_time(shape) == pytest.approx(2e-3 + 3.0 * kernels.step_time(shape), rel=0.05)


def test_the_engines_pages_give_its_blocks_or_a_clear_error() -> None:
    page = ('# HELP vllm:cache_config_info x\nvllm:cache_config_info{block_size="128",engine="0",'
            'num_gpu_blocks="1456",cache_dtype="auto"} 1.0\n')
    facts = engine_facts(page, max_model_len=2048, url="http://engine")
    assert (facts.block_size, facts.kv_blocks, facts.max_model_len) == (128, 1456, 2048)
    with pytest.raises(BackendUnavailableError, match="http://engine/metrics has no vllm:cache_config_info"):
        engine_facts("sglang:token_usage 0.1\n", max_model_len=None, url="http://engine")
    with pytest.raises(InputError, match="streamed a token"):
        step_samples([])


def test_calibrate_endpoint_fits_a_twin_to_a_running_engine(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("HETSCHED_DATABASE_URL", f"sqlite:///{tmp_path}/store.sqlite")
    engine = EngineConfig(max_num_seqs=16, max_num_batched_tokens=2048, block_size=32)
    with start_worker_thread(WorkerSpec(model="qwen3-0.6b", accelerator="h100-sxm", engine=engine,
                                        kv_blocks=900)) as server:
        result = CliRunner().invoke(app, ["calibrate", "h100-sxm", "--endpoint", server.url, "--model", "qwen3-0.6b",
                                          "--rates", "4,16", "--requests", "16", "--prompt-tokens", "64,512",
                                          "--output-tokens", "64", "-o", "json"])
    assert result.exit_code == 0, result.output
    fitted = json.loads(result.stdout)
    assert fitted["engine"] == {"block_size": 32, "kv_blocks": 900, "max_model_len": 8192}
    assert fitted["residuals"]["decode"]["median_abs"] < 0.15
    assert "--kv-blocks 900" in fitted["twin"] and fitted["id"] is not None
    refused = CliRunner().invoke(app, ["calibrate", "h100-sxm", "--endpoint", server.url])
    assert isinstance(refused.exception, InputError) and "--model" in str(refused.exception)


def test_calibrate_endpoint_fits_the_front_end_of_an_engine_that_has_one(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("HETSCHED_DATABASE_URL", f"sqlite:///{tmp_path}/store.sqlite")
    engine = EngineConfig(max_num_seqs=16, max_num_batched_tokens=2048, block_size=32)
    spec = WorkerSpec(model="qwen3-0.6b", accelerator="h100-sxm", engine=engine, kv_blocks=900,
                      tail=Tail(front_end=FrontEnd(request_s=0.02)))
    with start_worker_thread(spec) as server:
        result = CliRunner().invoke(app, ["calibrate", "h100-sxm", "--endpoint", server.url, "--model", "qwen3-0.6b",
                                          "--rates", "2,8", "--requests", "12", "--prompt-tokens", "64",
                                          "--output-tokens", "16", "-o", "json"])
    assert result.exit_code == 0, result.output
    fitted = json.loads(result.stdout)
    front = fitted["tail"]["front_end"]
    # the clients' TTFT less the engine's own: the twin's 20 ms a request, and its HTTP handling beside it
    assert 0.015 <= front["request_s"] <= 0.035, front
    assert "--frontend-request-ms" in fitted["twin"]
    # what the front end explains is no longer counted as request overhead too: the rest is its fixed latency
    assert front["latency_s"] == pytest.approx(fitted["request_overhead_ms"] / 1e3, rel=1e-3)
