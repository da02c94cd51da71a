"""A stand-in gateway for the EPP benchmark: Envoy's side of ext_proc (FULL_DUPLEX_STREAMED), timed as a client.

Per request it opens one ``Process`` stream, sends ``request_headers`` and the body in chunks, reads the pick
(``x-gateway-destination-endpoint``) and the body handed back, forwards the request to the first picked endpoint
that accepts a connection (the next on a refused one, as Envoy's retry does), and streams the endpoint's answer
back through the EPP: ``response_headers``, then each body chunk as it arrives, the EPP's answers read as they
come (the writes and reads overlap, as Envoy's do). A token reaches the client when the EPP hands back the chunk
that carries it, so that is when it is timed. Without an HTTP client the answer is a canned SSE stream (the EPP
still does its whole per-request work; nothing is forwarded).

``tests/envoy_double.py`` plays the same protocol for the EPP's tests, where every field of the exchange is
checked; this one keeps what the benchmark needs: the decision's latency and the client's token times.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping

import grpc
import httpx
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
from google.protobuf.struct_pb2 import Struct

from _loadgen import Outcome

DESTINATION_HEADER = "x-gateway-destination-endpoint"
CANNED_STREAM = (*(b'data: {"choices":[{"index":0,"text":"tok"}]}\n\n' for _ in range(4)), b"data: [DONE]\n\n")
"""A short streamed completion: four token events, then the end."""


def _headers(pairs: Mapping[str, str], *, end: bool) -> pb.HttpHeaders:
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return pb.HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end)


def _served(address: str) -> Metadata:
    """The endpoint that served the request, as Envoy reports it to the EPP."""
    struct = Struct()
    struct.update({"x-gateway-destination-endpoint-served": address})
    return Metadata(filter_metadata={"envoy.lb": struct})


def tokens_in(chunk: bytes) -> int:
    """Token events in an SSE chunk, counted as ``_loadgen.stream_once`` counts them."""
    return chunk.count(b"data:") - chunk.count(b"data: [DONE]")


class Gateway:
    """Envoy's side of the exchange with an EPP at ``channel``; ``http`` reaches the endpoints (None: canned)."""

    def __init__(self, channel: grpc.aio.Channel, http: httpx.AsyncClient | None = None, *,
                 chunk_bytes: int = 4096) -> None:
        self.stub = ExternalProcessorStub(channel)
        self.http = http
        self.chunk_bytes = chunk_bytes

    async def request(self, body: bytes, *, kind: str = "", expected: int = 0,
                      path: str = "/v1/completions") -> tuple[Outcome, float]:
        """The request as its client saw it, and the decision's latency in seconds: from sending the body's last
        chunk to reading the EPP's answer to the headers (NaN when there was none)."""
        out = Outcome(kind, time.monotonic(), expected=expected)
        call = self.stub.Process()
        decision = float("nan")
        try:
            decision, picked = await self._pick(call, body, path, out)
            if picked:
                await self._respond(call, body, path, picked, out)
        except grpc.aio.AioRpcError as exc:
            out.error = f"ext_proc {exc.code().name}: {exc.details()}"
        except httpx.HTTPError as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        finally:
            call.cancel()
        return out, decision

    async def _pick(self, call: grpc.aio.StreamStreamCall, body: bytes, path: str,
                    out: Outcome) -> tuple[float, list[str]]:
        """Send the request; the decision's latency and the picked endpoints (``ip:port``, first choice first),
        after reading the body handed back. An immediate response from the EPP is the answer: no endpoints."""
        head = {":method": "POST", ":path": path, ":authority": "gateway", "content-type": "application/json",
                "content-length": str(len(body))}
        await call.write(pb.ProcessingRequest(request_headers=_headers(head, end=False)))
        pieces = [body[i:i + self.chunk_bytes] for i in range(0, len(body), self.chunk_bytes)] or [b""]
        for piece in pieces[:-1]:
            await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=piece)))
        sent = time.perf_counter()
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=pieces[-1], end_of_stream=True)))
        answer = await call.read()
        decision = time.perf_counter() - sent
        if answer.HasField("immediate_response"):
            out.status, out.error = answer.immediate_response.status.code, answer.immediate_response.body[:200].decode()
            return decision, []
        mutation = {h.header.key: h.header.raw_value.decode()
                    for h in answer.request_headers.response.header_mutation.set_headers}
        while not (await call.read()).request_body.response.body_mutation.streamed_response.end_of_stream:
            pass
        return decision, mutation[DESTINATION_HEADER].split(",")

    async def _respond(self, call: grpc.aio.StreamStreamCall, body: bytes, path: str, picked: list[str],
                       out: Outcome) -> None:
        """Forward the request, and pass the answer through the EPP to the client, timing its tokens."""
        if self.http is None:
            await self._relay(call, picked[0], 200, "text/event-stream", _canned(), out)
            return
        for address in picked:
            request = self.http.build_request("POST", f"http://{address}{path}", content=body,
                                              headers={"content-type": "application/json"})
            try:
                response = await self.http.send(request, stream=True)
            except httpx.ConnectError:
                continue
            try:
                await self._relay(call, address, response.status_code, response.headers.get("content-type", ""),
                                  response.aiter_raw(), out)
            finally:
                await response.aclose()
            return
        out.status, out.error = 503, "no picked endpoint accepted a connection"

    async def _relay(self, call: grpc.aio.StreamStreamCall, address: str, status: int, content_type: str,
                     chunks: AsyncIterator[bytes], out: Outcome) -> None:
        out.status, out.endpoint = status, f"http://{address}"
        await call.write(pb.ProcessingRequest(
            response_headers=_headers({":status": str(status), "content-type": content_type}, end=False),
            metadata_context=_served(address)))
        await call.read()

        async def send() -> None:
            try:
                async for chunk in chunks:
                    if chunk:
                        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk)))
            except httpx.HTTPError as exc:  # the endpoint broke off: the answer ends here, short of its tokens
                out.error = f"{type(exc).__name__}: {exc}"
            await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True)))
            await call.done_writing()

        writer = asyncio.create_task(send())
        try:
            first = last = 0.0
            while True:
                answer = await call.read()
                if answer is grpc.aio.EOF:
                    out.error = "the EPP ended the stream before the answer's end"
                    break
                streamed = answer.response_body.response.body_mutation.streamed_response
                n = tokens_in(streamed.body)
                if status != 200 or b'"error"' in streamed.body:
                    out.error = streamed.body[:200].decode(errors="replace") or out.error
                if n > 0:
                    now = time.monotonic()
                    if not out.tokens:
                        first, out.ttft, out.started_streaming = now, now - out.sent, True
                    last = now
                    out.tokens += n
                if streamed.end_of_stream:
                    await writer
                    break
            if out.tokens > 1:
                out.tpot = (last - first) / (out.tokens - 1)
        finally:
            writer.cancel()


async def _canned() -> AsyncIterator[bytes]:
    for chunk in CANNED_STREAM:
        yield chunk
