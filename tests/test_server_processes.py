"""Several server processes on one port (``hetsched route --workers N``): each answers, ``/metrics`` sums them all,
and a signal stops all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import yaml

from hetsched.simworker.launch import free_port

SERVER = textwrap.dedent("""
    import os, sys
    from hetsched.server.serve import serve_processes, uvicorn_options
    from hetsched.settings.server import ServerLimits

    def make_app():
        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": str(os.getpid()).encode()})
        return app

    options = {"log_level": "warning", "lifespan": "off", **uvicorn_options(ServerLimits())}
    sys.exit(serve_processes(make_app, host="127.0.0.1", port=int(sys.argv[1]), workers=2, options=options))
""")


def _answers(url: str, *, connections: int, deadline: float) -> set[str]:
    """The pids that answered ``connections`` new connections (each its own source port, so its own hash)."""
    pids: set[str] = set()
    while time.monotonic() < deadline and len(pids) < 2:
        for _ in range(connections):
            try:
                with httpx.Client() as client:  # a new connection each time
                    pids.add(client.get(url, timeout=1).text)
            except httpx.HTTPError:
                time.sleep(0.1)  # not listening yet
    return pids


def test_two_processes_share_the_port_and_stop_together() -> None:
    port = free_port()
    parent = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stderr=subprocess.PIPE)
    try:
        pids = _answers(f"http://127.0.0.1:{port}/", connections=20, deadline=time.monotonic() + 60)
        assert len(pids) == 2 and str(parent.pid) not in pids  # each child answers; the parent never does
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(30) == 0, parent.stderr.read().decode() if parent.stderr else ""
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(int(pid), 0)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_route_with_two_workers_answers_metrics_summed_over_both(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"port": port, "health": {"check_interval_s": 60}, "models": {
        "qwen3-0.6b": {"endpoints": [{"url": "http://127.0.0.1:9", "accelerator": "l4"}]}}}))  # nothing listens
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    router = subprocess.Popen([sys.executable, "-m", "hetsched", "route", "--config", str(config), "--workers", "2",
                               "--log-level", "warning"], env=env, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        sent = 0
        deadline = time.monotonic() + 90
        while sent < 20 and time.monotonic() < deadline:
            try:
                with httpx.Client() as client:  # a new connection each: both processes take some
                    answer = client.post(f"{url}/v1/completions", timeout=5,
                                         json={"model": "qwen3-0.6b", "prompt": "hi", "max_tokens": 1})
                assert answer.status_code in (502, 503)  # refused upstream, then ejected: a refusal either way
                sent += 1
            except httpx.TransportError:
                time.sleep(0.2)  # not listening yet
        assert sent == 20
        for _ in range(4):  # whichever process answers, it counts all 20
            with httpx.Client() as client:
                text = client.get(f"{url}/metrics", timeout=5).text
            rejected = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("hetsched_router_rejected_total{")]
            assert sum(rejected) == 20.0
    finally:
        router.send_signal(signal.SIGTERM)
        assert router.wait(30) == 0, router.stderr.read().decode() if router.stderr else ""
