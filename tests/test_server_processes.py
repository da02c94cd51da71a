"""Several server processes on one port (``hetsched route --workers N``): each answers, and a signal stops all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from hetsched.simworker.launch import free_port

SERVER = textwrap.dedent("""
    import os, sys
    from hetsched.server.limits import ServerLimits
    from hetsched.server.serve import serve_processes, uvicorn_options

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
