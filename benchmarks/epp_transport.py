"""What a Python gRPC server costs per ext_proc message, against what ``hetsched epp`` spends per request.

A gateway sends the EPP one ``ProcessingRequest`` per request header block, body chunk, response header block and
response body chunk (FULL_DUPLEX_STREAMED), and the EPP answers each. This benchmark serves the ext_proc stream three
ways, each in a child process of its own, and plays the gateway from this one (each message answered before the
next is sent, 32 streams at a time): request headers, a 2 KB body, response headers, then ``--chunks`` SSE chunks.

- ``aio no-op``: ``grpc.aio`` with a servicer that only answers (the transport alone);
- ``sync no-op``: ``grpc``'s thread-pool server with the same servicer;
- ``hetsched epp``: the EPP's servicer over a picker of eight static endpoints (policy ``slo``): its whole work.

It prints each one's CPU per stream and per message (from ``/proc``, the child's own), and the share of the EPP's
CPU the transport alone takes: the floor a Python EPP cannot go below.

``--quick``: a few streams per way, a check that it runs.

Run: ``.venv/bin/python benchmarks/epp_transport.py`` (under a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from concurrent import futures

import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import (ExternalProcessorServicer,
                                                                   ExternalProcessorStub,
                                                                   add_ExternalProcessorServicer_to_server)

from _loadgen import process_cpu_seconds
from hetsched.simworker.launch import free_port
import report

MODES = ("aio no-op", "sync no-op", "hetsched epp")
CONCURRENCY = 32
POOL = (("h100-sxm", 2), ("a100-80gb", 2), ("l4", 4))


def _answer(request: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
    kind = request.WhichOneof("request")
    if kind == "request_headers":
        return None
    if kind == "request_body":
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse()) if request.request_body.end_of_stream \
            else None
    if kind == "response_headers":
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    body = request.response_body
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=body.body,
                                                                                 end_of_stream=body.end_of_stream)))))


class AsyncNoOp(ExternalProcessorServicer):
    async def Process(self, requests, context):  # type: ignore[no-untyped-def]  # noqa: N802 - gRPC's name
        async for request in requests:
            if (answer := _answer(request)) is not None:
                yield answer


class SyncNoOp(ExternalProcessorServicer):
    def Process(self, requests, context):  # type: ignore[no-untyped-def]  # noqa: N802 - gRPC's name
        for request in requests:
            if (answer := _answer(request)) is not None:
                yield answer


def serve(mode: str, port: int) -> None:
    """The child: one server in ``mode`` on ``port``, until killed."""
    address = f"127.0.0.1:{port}"
    if mode == "sync no-op":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=CONCURRENCY))
        add_ExternalProcessorServicer_to_server(SyncNoOp(), server)
        server.add_insecure_port(address)
        server.start()
        print("ready", flush=True)
        server.wait_for_termination()
        return

    async def main() -> None:
        aio = grpc.aio.server()
        if mode == "aio no-op":
            add_ExternalProcessorServicer_to_server(AsyncNoOp(), aio)
        else:
            from hetsched.catalog.host import read_host
            from hetsched.router.config import parse_router_config
            from hetsched.router.epp import ExtProcServicer
            from hetsched.router.picker import Picker
            from hetsched.router.types import Front
            config = parse_router_config({"models": {"llama-3.1-8b": {
                "slo": {"ttft_ms": 1000, "tpot_ms": 100},
                "endpoints": [{"url": f"http://10.0.{i}.{j}:8000", "accelerator": acc}
                              for i, (acc, n) in enumerate(POOL) for j in range(n)]}}})
            add_ExternalProcessorServicer_to_server(
                ExtProcServicer(Picker(config, front=Front.EPP, host=read_host())), aio)
        aio.add_insecure_port(address)
        await aio.start()
        print("ready", flush=True)
        await aio.wait_for_termination()

    asyncio.run(main())


def _headers(pairs: dict[str, str]) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode())
                                                     for k, v in pairs.items()]))


async def _stream(stub: ExternalProcessorStub, chunks: int) -> None:
    body = json.dumps({"model": "llama-3.1-8b", "prompt": "word " * 400, "max_tokens": chunks, "stream": True})
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=_headers(
        {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"})))
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body.encode(), end_of_stream=True)))
    await call.read()
    await call.write(pb.ProcessingRequest(response_headers=_headers(
        {":status": "200", "content-type": "text/event-stream"})))
    await call.read()
    for i in range(chunks):
        chunk = b'data: {"choices": [{"text": " word"}]}\n\n'
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=i == chunks - 1)))
        await call.read()
    await call.done_writing()
    await call.read()


async def measure(mode: str, streams: int, chunks: int) -> float:
    """CPU seconds the server of ``mode`` spent per stream."""
    port = free_port()
    child = subprocess.Popen([sys.executable, __file__, "--serve", mode, "--port", str(port)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ExternalProcessorStub(channel)
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one() -> None:
                async with gate:
                    await _stream(stub, chunks)

            await asyncio.gather(*(one() for _ in range(CONCURRENCY)))  # warm up
            before = process_cpu_seconds(child.pid)
            await asyncio.gather(*(one() for _ in range(streams)))
            return (process_cpu_seconds(child.pid) - before) / streams
    finally:
        child.kill()
        child.wait()


async def main(args: argparse.Namespace) -> None:
    streams = 40 if args.quick else args.streams
    messages = 3 + args.chunks
    print(f"{streams} streams per way, {CONCURRENCY} at a time; each: request headers, a body, response headers, "
          f"{args.chunks} SSE chunks ({messages} messages, {messages - 1} answers); machine {os.cpu_count()} cores")
    print(f"{'server':14} {'CPU/stream':>11} {'CPU/message':>12}")
    cpu = {}
    for mode in MODES:
        cpu[mode] = await measure(mode, streams, args.chunks)
        print(f"{mode:14} {cpu[mode] * 1e3:>9.2f}ms {cpu[mode] / messages * 1e6:>10.0f}us", flush=True)
    print(f"the transport alone (aio no-op) is {cpu['aio no-op'] / cpu['hetsched epp']:.0%} of the EPP's CPU per "
          f"stream; the sync server {cpu['sync no-op'] / cpu['aio no-op']:.2f}x the aio one")


if __name__ == "__main__":
    if "--serve" in sys.argv:
        parser = argparse.ArgumentParser()
        parser.add_argument("--serve", choices=MODES)
        parser.add_argument("--port", type=int)
        served = parser.parse_args()
        serve(served.serve, served.port)
    else:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--streams", type=int, default=600)
        parser.add_argument("--chunks", type=int, default=40)
        parser.add_argument("--quick", action="store_true")
        report.main(lambda: asyncio.run(main(parser.parse_args())), section="epp_transport")
