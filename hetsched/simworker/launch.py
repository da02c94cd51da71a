"""Start simulated workers (or any ASGI app) programmatically: in a thread for tests, as a process for load.

``serve_in_thread(app)`` runs uvicorn on an ephemeral loopback port in a
background thread; ``spawn_worker(spec)`` runs ``hetsched sim-worker`` as a
child process (so it can be killed like a crashed replica). Both wait until
the server answers and return a handle with its ``url``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn
from starlette.types import ASGIApp

from hetsched.errors import BackendUnavailableError
from hetsched.kvcache.hashing import DEFAULT_SEED
from hetsched.server.serve import uvicorn_options
from hetsched.settings.server import ServerLimits
from hetsched.simworker.app import WorkerSpec, create_worker_app


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    with _bind(host, 0) as sock:
        return sock.getsockname()[1]


@dataclass
class ThreadServer:
    """A uvicorn server running in a daemon thread."""

    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, *, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ThreadServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_in_thread(app: ASGIApp, *, host: str = "127.0.0.1", port: int = 0, timeout: float = 10.0,
                    limits: ServerLimits = ServerLimits()) -> ThreadServer:
    """Serve ``app`` on ``host:port`` (0: any free port) until :meth:`ThreadServer.stop`, under ``limits``'s
    connection timeouts as ``hetsched`` commands serve."""
    sock = _bind(host, port)
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1,
                            access_log=False, **uvicorn_options(limits))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, args=([sock],), daemon=True,
                              name=f"uvicorn-{sock.getsockname()[1]}")
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise BackendUnavailableError(f"server on {host}:{sock.getsockname()[1]} did not start")
        time.sleep(0.01)
    return ThreadServer(f"http://{host}:{sock.getsockname()[1]}", server, thread)


def start_worker_thread(spec: WorkerSpec) -> ThreadServer:
    """A simulated worker in this process (fast to start; shares the interpreter)."""
    return serve_in_thread(create_worker_app(spec))


@dataclass
class WorkerProcess:
    """A ``hetsched sim-worker`` child process."""

    url: str
    spec: WorkerSpec
    process: subprocess.Popen[bytes]

    def kill(self) -> None:
        """End it at once, like a crashed replica (SIGKILL)."""
        self.process.kill()
        self.process.wait()

    def stop(self, *, timeout: float = 5.0) -> None:
        """End it gracefully (SIGTERM), then kill it if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def spawn_worker(spec: WorkerSpec, *, port: int | None = None, host: str = "127.0.0.1",
                 timeout: float = 30.0) -> WorkerProcess:
    """Run ``hetsched sim-worker`` for ``spec`` and wait until it answers ``/health``."""
    port = port or free_port(host)
    args = [sys.executable, "-m", "hetsched", "sim-worker", "--model", spec.model, "--accelerator", spec.accelerator,
            "--tp", str(spec.tp), "--time-scale", str(spec.time_scale), "--max-model-len", str(spec.max_model_len),
            "--role", str(spec.role), "--min-step-wall-ms", str(spec.min_step_wall_s * 1e3),
            "--slowdown-prefill", str(spec.slowdown_prefill), "--slowdown-decode", str(spec.slowdown_decode),
            "--host", host, "--port", str(port)]
    if spec.served_name:
        args += ["--served-model-name", spec.served_name]
    if spec.kv_blocks is not None:
        args += ["--kv-blocks", str(spec.kv_blocks)]
    if spec.tail is not None:
        if spec.tail.dispersion is not None:
            args += ["--step-dispersion", spec.tail.dispersion.spec]
        if spec.tail.front_end is not None:
            args += ["--frontend-request-ms", repr(spec.tail.front_end.request_s * 1e3),
                     "--frontend-token-ms", repr(spec.tail.front_end.token_s * 1e3)]
        args += ["--seed", str(spec.seed)]
    if not spec.prefix_caching:
        args.append("--no-prefix-caching")
    args += ["--prefix-caching-hash-algo", str(spec.hash_algorithm)]
    for flag, value in (("--tokenizer", spec.tokenizer), ("--kv-events", spec.kv_events),
                        ("--kv-events-replay", spec.kv_events_replay)):
        if value is not None:
            args += [flag, value]
    if spec.kv_events_topic:
        args += ["--kv-events-topic", spec.kv_events_topic]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONHASHSEED"}
    if spec.hash_seed != DEFAULT_SEED:  # the child reads its block hashes' seed there, as vLLM does
        env["PYTHONHASHSEED"] = spec.hash_seed
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**env, "PYTHONUNBUFFERED": "1"})
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            err = process.stderr.read().decode() if process.stderr else ""
            raise BackendUnavailableError(f"sim-worker exited with {process.returncode}: {err.strip()[-500:]}")
        try:
            if httpx.get(f"{url}/health", timeout=0.5).status_code == 200:
                return WorkerProcess(url, spec, process)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    process.kill()
    raise BackendUnavailableError(f"sim-worker on {url} did not answer /health within {timeout} s")
