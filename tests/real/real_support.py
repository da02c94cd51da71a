"""What the real-engine tests share: the marks, the engine's facts, routers in front of it, a relay to kill."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from hetsched.simworker.launch import free_port

URL_ENV, MODEL_DIR_ENV = "HETSCHED_REAL_VLLM_URL", "HETSCHED_REAL_MODEL_DIR"
KV_EVENTS_ENV, KV_REPLAY_ENV, BLOCK_SIZE_ENV = ("HETSCHED_REAL_KV_EVENTS", "HETSCHED_REAL_KV_REPLAY",
                                                "HETSCHED_REAL_BLOCK_SIZE")
REAL_ENGINE = [pytest.mark.real_engine, pytest.mark.skipif(
    not os.environ.get(URL_ENV),
    reason=f"no real vLLM engine: run `make test-real`, or set {URL_ENV} to a running vLLM OpenAI server")]
"""``pytestmark`` of every real-engine test module."""


@dataclass(frozen=True)
class Engine:
    """The running engine: its URL, served model name and the model folder it serves."""

    url: str
    model: str
    model_dir: Path
    max_model_len: int


@dataclass(frozen=True)
class KVEvents:
    """Where the engine publishes its KV-cache events, and the block size its prefix cache hashes."""

    endpoint: str
    replay: str
    block_size: int


@dataclass
class RouterProcess:
    """``hetsched route`` as a child process, as it is deployed."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_router(engine: Engine, endpoint_url: str, folder: Path) -> RouterProcess:
    """A router whose static endpoint file names one ``cpu`` endpoint serving the engine's model."""
    port = free_port()
    config = {"host": "127.0.0.1", "port": port, "metrics_interval_s": 0.5,
              "health": {"check_interval_s": 0.5, "check_timeout_s": 1.0, "eject_after_failures": 2,
                         "base_ejection_s": 60},
              "models": {engine.model: {"arch": str(engine.model_dir.resolve() / "config.json"),
                                        "max_model_len": engine.max_model_len,
                                        "endpoints": [{"url": endpoint_url, "accelerator": "cpu"}]}}}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    log = folder / "router.log"
    env = {**os.environ, "HETSCHED_DATABASE_URL": f"sqlite:///{folder / 'store.sqlite'}"}
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "hetsched", "route", "--config", str(path),
                                    "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT, env=env)
    router = RouterProcess(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{router.url}/health", timeout=1).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            router.stop()
            pytest.fail(f"hetsched route did not answer {router.url}/health; its log:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


@dataclass
class Relay:
    """A loopback TCP relay to the engine: stopping it is, to the router, the engine being killed.

    Every open connection is cut at once and nothing listens on the port afterwards, while the real engine
    (which the other tests share) keeps running.
    """

    target_port: int
    url: str = ""
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _transports: list[asyncio.BaseTransport] = field(default_factory=list)
    _server: asyncio.Server | None = None

    def start(self) -> Relay:
        ready = threading.Event()

        async def serve() -> None:
            self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
            ready.set()

        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop)
        ready.wait(10)
        return self

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._transports += [writer.transport, up_writer.transport]
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)

    def kill(self) -> None:
        async def cut() -> None:
            assert self._server is not None
            self._server.close()
            for transport in self._transports:
                transport.abort()

        asyncio.run_coroutine_threadsafe(cut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


def wait_for(check: Callable[[], bool], *, timeout: float, what: str) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.1)
