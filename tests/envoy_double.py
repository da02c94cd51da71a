"""A gateway double that plays Envoy's side of the ext_proc protocol (FULL_DUPLEX_STREAMED) against an EPP.

For each request it sends ``request_headers``, then the body in chunks, reads the pick, forwards the request to
the picked endpoint (the next one in the list when that one cannot be reached, as Envoy's retry does), and
streams the endpoint's answer back as ``response_headers`` / ``response_body`` messages, reporting the endpoint
that served it. Without an HTTP client it answers from a canned engine response instead of forwarding.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
import httpx
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
from google.protobuf.struct_pb2 import Struct

CANNED_STREAM = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n',
                 b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\ndata: [DONE]\n\n']


@dataclass
class GatewayResult:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    picked: list[str] = field(default_factory=list)
    """The EPP's destination list, ``ip:port`` in order."""
    metadata_pick: str | None = None
    served: str | None = None
    forwarded_body: bytes = b""
    immediate: bool = False
    broken: bool = False
    """The endpoint broke off mid-answer: the double reset the stream, as Envoy does."""


def _headers(pairs: Mapping[str, str], *, end: bool) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
                          end_of_stream=end)


def _metadata(namespace: str, key: str, value: object) -> Metadata:
    struct = Struct()
    struct.update({key: value})
    return Metadata(filter_metadata={namespace: struct})


class EnvoyDouble:
    def __init__(self, channel: grpc.aio.Channel, http: httpx.AsyncClient | None = None) -> None:
        self.stub = ExternalProcessorStub(channel)
        self.http = http

    async def request(self, body: bytes | None, *, path: str = "/v1/completions", headers: Mapping[str, str] = {},
                      chunk_bytes: int = 1 << 16, subset: object = None, cancel_after_chunks: int | None = None,
                      served_override: str | None = None) -> GatewayResult:
        call = self.stub.Process()
        try:
            return await self._exchange(call, body, path, headers, chunk_bytes, subset, cancel_after_chunks,
                                        served_override)
        finally:
            call.cancel()

    async def _exchange(self, call, body, path, headers, chunk_bytes, subset, cancel_after_chunks,
                        served_override) -> GatewayResult:
        head = {":method": "POST" if body is not None else "GET", ":path": path, ":authority": "gw",
                "content-type": "application/json", **headers}
        if body is not None:
            head["content-length"] = str(len(body))
        first = pb.ProcessingRequest(request_headers=_headers(head, end=body is None))
        if subset is not None:
            first.metadata_context.CopyFrom(_metadata("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset",
                                                      subset))
        await call.write(first)

        async def send_body() -> None:
            """The body's chunks, written while the answer is awaited: an EPP may answer (a 413) and end the
            stream before the last one, and then Envoy stops sending, as this does."""
            assert body is not None
            pieces = [body[i:i + chunk_bytes] for i in range(0, len(body), chunk_bytes)] or [b""]
            for i, piece in enumerate(pieces):
                await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=piece,
                                                                               end_of_stream=i == len(pieces) - 1)))

        writer = asyncio.ensure_future(send_body() if body is not None else asyncio.sleep(0))
        answer = await call.read()
        if answer.HasField("immediate_response"):
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
        else:
            await writer
        if answer.HasField("immediate_response"):
            im = answer.immediate_response
            return GatewayResult(im.status.code, im.body, {h.header.key: h.header.raw_value.decode()
                                                           for h in im.headers.set_headers}, immediate=True)
        assert answer.HasField("request_headers"), answer
        mutation = {h.header.key: h.header.raw_value.decode()
                    for h in answer.request_headers.response.header_mutation.set_headers}
        picked = mutation["x-gateway-destination-endpoint"].split(",")
        lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
        result = GatewayResult(0, picked=picked, metadata_pick=lb["x-gateway-destination-endpoint"].string_value,
                               headers=mutation)
        forwarded = b""
        if body is not None:
            while True:
                part = await call.read()
                streamed = part.request_body.response.body_mutation.streamed_response
                forwarded += streamed.body
                if streamed.end_of_stream:
                    break
        result.forwarded_body = forwarded
        status, chunks, served, broken = await self._forward(picked, path, forwarded if body is not None else None)
        result.served, result.broken = served_override or served, broken
        if broken:
            cancel_after_chunks = len(chunks)
        result.status = status
        content_type = "text/event-stream" if chunks and chunks[0].startswith(b"data:") else "application/json"
        served_meta = _metadata("envoy.lb", "x-gateway-destination-endpoint-served", result.served)
        await call.write(pb.ProcessingRequest(response_headers=_headers({":status": str(status),
                                                                         "content-type": content_type}, end=False),
                                              metadata_context=served_meta))
        reply = await call.read()
        assert reply.HasField("response_headers"), reply
        for i, piece in enumerate([*chunks, b""]):
            if cancel_after_chunks is not None and i == cancel_after_chunks:
                call.cancel()
                return result
            end = i == len(chunks)
            await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=piece, end_of_stream=end)))
            back = await call.read()
            streamed = back.response_body.response.body_mutation.streamed_response
            result.body += streamed.body
            assert streamed.end_of_stream == end
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        return result

    async def _forward(self, picked: list[str], path: str, body: bytes | None) -> tuple[int, list[bytes], str, bool]:
        """The answer of the first picked endpoint that can be reached (a 503 when none can), and whether it
        broke off after its head."""
        if self.http is None:
            return 200, list(CANNED_STREAM), picked[0], False
        for address in picked:
            request = self.http.build_request("POST" if body is not None else "GET", f"http://{address}{path}",
                                              content=body, headers={"content-type": "application/json"})
            try:
                response = await self.http.send(request, stream=True)
            except httpx.TransportError:
                continue
            chunks: list[bytes] = []
            try:
                async for chunk in response.aiter_raw():
                    if chunk:
                        chunks.append(chunk)
            except httpx.TransportError:
                return response.status_code, chunks, address, True
            finally:
                await response.aclose()
            return response.status_code, chunks, address, False
        return 503, [json.dumps({"error": {"message": "no upstream"}}).encode()], picked[-1], False
