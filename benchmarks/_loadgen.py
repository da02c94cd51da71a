"""Open-loop streaming load against an OpenAI-compatible server, timing every token (router benchmarks)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import grpc
import httpx
import numpy as np
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetsched.errors import BackendUnavailableError
from hetsched.simworker.launch import free_port


@dataclass
class Outcome:
    """One request as the client saw it (wall seconds)."""

    kind: str
    sent: float
    status: int = 0
    ttft: float = float("nan")
    tpot: float = float("nan")
    tokens: int = 0
    expected: int = 0
    started_streaming: bool = False
    error: str | None = None
    endpoint: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.tokens == self.expected


async def stream_once(client: httpx.AsyncClient, url: str, *, model: str, prompt_tokens: int, max_tokens: int,
                      kind: str = "", headers: dict[str, str] | None = None) -> Outcome:
    body = {"model": model, "prompt": unique_prompt(prompt_tokens), "max_tokens": max_tokens, "stream": True}
    return await stream_body(client, url, body, kind=kind, headers=headers)


_PROMPTS = itertools.count()


def unique_prompt(tokens: int) -> str:
    """About ``tokens`` tokens of text that no other prompt of this process starts with: the engines' (and the
    twins') prefix caches hit nothing, as the simulator's capacities assume."""
    return f"request {next(_PROMPTS)}: " + "word " * max(tokens * 4 // 5 - 3, 1)


async def stream_body(client: httpx.AsyncClient, url: str, body: dict, *, kind: str = "",
                      headers: dict[str, str] | None = None) -> Outcome:
    """One streamed ``/v1/completions`` of ``body`` through ``url``, every token timed (wall seconds)."""
    out = Outcome(kind, time.monotonic(), expected=body["max_tokens"])
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            out.status = response.status_code
            out.endpoint = response.headers.get("x-hetsched-endpoint", "")
            if response.status_code != 200:
                await response.aread()
                out.error = response.text[:200]
                return out
            first = last = 0.0
            async for chunk in response.aiter_raw():
                n = chunk.count(b"data:") - chunk.count(b"data: [DONE]")
                if b'"error"' in chunk:
                    out.error = "stream error event"
                if n <= 0:
                    continue
                now = time.monotonic()
                if not out.tokens:
                    first = now
                    out.ttft = now - out.sent
                    out.started_streaming = True
                last = now
                out.tokens += n
            if out.tokens > 1:
                out.tpot = (last - first) / (out.tokens - 1)
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def pct(values: list[float], q: float) -> float:
    arr = np.array([v for v in values if v == v])
    return float(np.percentile(arr, q)) if len(arr) else float("nan")


class RouterProcess:
    """``hetsched route`` in a child process, optionally pinned to CPU cores."""

    def __init__(self, config: dict, *, cpu: int | set[int] | None = None, source: str | None = None,
                 profile: str | None = None, workers: int = 1) -> None:
        """``source``: a directory holding another ``hetsched`` package to run (a baseline revision);
        ``profile``: where cProfile writes the router's profile when it stops; ``workers``: router processes."""
        self.port = free_port()
        handle = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        yaml.safe_dump({**config, "port": self.port}, handle)
        handle.close()
        self.config_path = handle.name
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        env = dict(os.environ)
        if source is not None:
            env["PYTHONPATH"] = os.pathsep.join([source, *filter(None, [env.get("PYTHONPATH")])])
        profiler = ["-m", "cProfile", "-o", profile] if profile is not None else []
        self.profiled = profile is not None
        cores = {cpu} if isinstance(cpu, int) else cpu
        self.process = subprocess.Popen(
            [sys.executable, *profiler, "-m", "hetsched", "route", "--config", handle.name, "--log-level", "warning",
             *(["--workers", str(workers)] if workers > 1 else [])],
            stdout=subprocess.DEVNULL, stderr=self.log, env=env, cwd=source,  # ``-m`` puts the cwd first on the path
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores is not None else None)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 90  # a loaded 2-core machine takes tens of seconds to import it all
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BackendUnavailableError(f"router exited: {self.errors()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=0.5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise BackendUnavailableError("router did not start")

    def pids(self) -> list[int]:
        """The router's process and its worker processes (``--workers``)."""
        found = [self.process.pid]
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as stat:
                        if int(stat.read().rsplit(")", 1)[1].split()[1]) == self.process.pid:
                            found.append(int(entry))
                except (OSError, IndexError, ValueError):
                    continue
        return found

    def cpu_seconds(self) -> float:
        """CPU time of the router's processes so far (user and system)."""
        return sum(process_cpu_seconds(pid) for pid in self.pids())

    def errors(self) -> str:
        """The router's log lines that report errors (tracebacks included)."""
        return _log_errors(self.log.name)

    def stop(self) -> None:
        # uvicorn re-raises the signal it stopped on; only SIGINT's (KeyboardInterrupt) lets cProfile write its file
        _stop_child(self.process, signal.SIGINT if self.profiled else signal.SIGTERM, "router", self.log.name,
                    self.config_path)


class EppProcess:
    """``hetsched epp --config FILE`` in a child process, optionally pinned to CPU cores; ready once its gRPC health
    service reports ``readiness`` SERVING (its endpoints' health and metrics read)."""

    def __init__(self, config: dict, *, cpu: int | set[int] | None = None) -> None:
        ports: set[int] = set()
        while len(ports) < 3:
            ports.add(free_port())
        self.port, self.health_port, self.metrics_port = sorted(ports)
        handle = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        yaml.safe_dump(config, handle)
        handle.close()
        self.config_path = handle.name
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cores = {cpu} if isinstance(cpu, int) else cpu
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hetsched", "epp", "--config", handle.name, "--port", str(self.port),
             "--health-port", str(self.health_port), "--metrics-port", str(self.metrics_port),
             "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=self.log,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores is not None else None)
        self.address = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + 90
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise BackendUnavailableError(f"epp exited: {self.errors() or self._tail()}")
                try:
                    check = health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=0.5)
                    if check.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise BackendUnavailableError("epp did not become ready")

    def cpu_seconds(self) -> float:
        """CPU time of the EPP's process so far (user and system, all its threads)."""
        return process_cpu_seconds(self.process.pid)

    def errors(self) -> str:
        """The EPP's log lines that report errors (tracebacks included)."""
        return _log_errors(self.log.name)

    def _tail(self) -> str:
        with open(self.log.name) as log:
            return log.read()[-2000:]

    def stop(self) -> None:
        _stop_child(self.process, signal.SIGTERM, "epp", self.log.name, self.config_path)


def _stop_child(process: subprocess.Popen, signum: int, name: str, log_path: str, config_path: str) -> None:
    """Stop a server child (killed after 15 s), print the errors its log reports, remove its files."""
    process.send_signal(signum)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
    errors = _log_errors(log_path)
    if errors:
        print(f"{name} errors:\n{errors}")
    os.unlink(config_path)
    os.unlink(log_path)


def _log_errors(path: str) -> str:
    """A child's log from its first traceback on (its last 3,000 characters); nothing without one."""
    with open(path) as log:
        text = log.read()
    return text[text.find("Traceback"):][-3000:] if "Traceback" in text else ""


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of process ``pid`` to ``cores`` (``os.sched_setaffinity`` sets one thread's)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except (ProcessLookupError, OSError):
            continue  # the thread ended


def process_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of one process (all its threads); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_idle(client: httpx.AsyncClient, urls: list[str], *, timeout: float = 60.0) -> None:
    """Until every worker reports nothing running or waiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = 0.0
        for url in urls:
            try:
                text = (await client.get(f"{url}/metrics")).text
            except httpx.HTTPError:
                continue
            for line in text.splitlines():
                if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
                    busy += float(line.rsplit(" ", 1)[1])
        if busy == 0:
            return
        await asyncio.sleep(0.2)
