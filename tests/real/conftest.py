"""Fixtures for the real-engine tests: the engine ``make test-real`` started and a router in front of it.

Tests here are marked ``real_engine`` and skipped unless ``HETSCHED_REAL_VLLM_URL`` names a running vLLM
OpenAI server (``tests/real/run.sh`` starts one and sets it): see ``real_support.REAL_ENGINE``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from real_support import (BLOCK_SIZE_ENV, KV_EVENTS_ENV, KV_REPLAY_ENV, MODEL_DIR_ENV, URL_ENV, Engine, KVEvents,
                          RouterProcess, start_router)


@pytest.fixture(scope="session")
def engine() -> Engine:
    url = os.environ[URL_ENV].rstrip("/")
    try:
        listed = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        pytest.fail(f"{url}/v1/models did not list a model ({exc}); expected the vLLM server run.sh started")
    model_dir = Path(os.environ.get(MODEL_DIR_ENV, ".real-model"))
    return Engine(url, listed["id"], model_dir, int(listed["max_model_len"]))


@pytest.fixture(scope="module")
def router(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """A router in front of the engine itself."""
    started = start_router(engine, engine.url, tmp_path_factory.mktemp("router"))
    yield started
    started.stop()


@pytest.fixture(scope="session")
def kv_events() -> KVEvents:
    """The engine's KV-event sockets, which run.sh names (skipped for an engine started without them)."""
    endpoint, replay = os.environ.get(KV_EVENTS_ENV), os.environ.get(KV_REPLAY_ENV)
    if not endpoint or not replay:
        pytest.skip(f"the engine publishes no KV events: set {KV_EVENTS_ENV} and {KV_REPLAY_ENV} (run.sh does)")
    return KVEvents(endpoint, replay, int(os.environ.get(BLOCK_SIZE_ENV, "16")))
