"""A simulated vLLM replica: the shared scheduler driven in (scaled) real time behind the OpenAI API."""

from hetsched.simworker.app import WorkerSpec, build_engine, create_worker_app
from hetsched.simworker.engine import RequestTiming, SimEngine
from hetsched.simworker.launch import (ThreadServer, WorkerProcess, serve_in_thread, spawn_worker,
                                       start_worker_thread)

__all__ = ["RequestTiming", "SimEngine", "ThreadServer", "WorkerProcess", "WorkerSpec", "build_engine",
           "create_worker_app", "serve_in_thread", "spawn_worker", "start_worker_thread"]
