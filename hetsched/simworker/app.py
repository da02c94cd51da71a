"""An OpenAI-compatible server that behaves like one vLLM replica of a model on one accelerator.

Every generated token is one SSE event when streaming; a chat stream opens,
as vLLM's does, with an event that carries only the role. Token text is a
fixed cycle of words: the simulation is about timing, not content. Prompts
are tokenized by the model's tokenizer where the worker has one (a chat
through its template, as vLLM does), else four bytes of text a token, exact
for token ids; ``/tokenize`` counts the same way. A worker may play one role
of disaggregated serving (:mod:`hetsched.simworker.roles`).

Like vLLM v1, the worker caches prompt blocks by vLLM's block hashes
(:mod:`hetsched.sim.prefix_cache`), counts ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits``, and can publish its KV events on ZMQ
(:mod:`hetsched.simworker.publisher`); ``/kv/lookup`` says how much of a prompt it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from hetsched.catalog import Device, host_catalog
from hetsched.catalog.perf import PerfConstants
from hetsched.errors import HetschedError, InfeasibleError, InputError
from hetsched.kvcache.hashing import DEFAULT_SEED, BlockHashing, HashAlgorithm, text_token_ids
from hetsched.perf.correction import StepCorrection, corrected
from hetsched.perf.memory import fit
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.tail import Tail
from hetsched.router.openai import (ApiKind, ErrorType, OpenAIRequest, error_body, max_tokens, parse_request,
                                    prompt_tokens, refusal_body, sse_event)
from hetsched.router.profiles import DEFAULT_MAX_MODEL_LEN
from hetsched.router.tokenize import PromptTokenizer, prompt_token_ids
from hetsched.server.guard import Guard
from hetsched.settings.server import ServerLimits
from hetsched.sim.roles import Role
from hetsched.simworker.engine import SimEngine
from hetsched.simworker.metrics import VllmMetrics
from hetsched.simworker.publisher import KVEventPublisher
from hetsched.simworker.roles import RolePlay
from hetsched.specs.engine import EngineConfig
from hetsched.specs.files import parse_json
from hetsched.specs.registry import load_model

TOKEN_IDS = 32000
"""Token ids the twin's ``/tokenize`` hands out are below this (any id is a valid prompt token to the twin)."""
WORDS = ("the", "model", "serves", "tokens", "on", "a", "simulated", "accelerator", "at", "scale")


@dataclass(frozen=True)
class WorkerSpec:
    """What one simulated replica is."""

    model: str
    accelerator: str
    """Catalog device id: ``h100-sxm``, ``h100-sxm:3g.40gb``, ``mi300x:cpx_nps4``, or ``cpu`` (this machine)."""
    tp: int = 1
    time_scale: float = 1.0
    """Simulated seconds per wall second: 10 runs the replica ten times faster than the hardware."""
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    served_name: str | None = None
    """Model name clients ask for (default: ``model``)."""
    engine: EngineConfig = EngineConfig()
    kv_blocks: int | None = None
    """KV cache blocks, as the engine copied states them (``num_gpu_blocks``); None: what the memory model fits."""
    perf: PerfConstants | None = None
    """Step-model constants in place of the device's (a calibration to a real engine)."""
    request_overhead_ms: float = 0.0
    """Front-end time per request before its first step (HTTP, tokenizing), as a calibration to an engine found."""
    min_step_wall_s: float = 0.002
    """Decode steps shorter than this in wall time run several at once, their tokens delivered together: at high
    ``time_scale`` this bounds the events per second a replica sends (see :class:`SimEngine`)."""
    role: Role = Role.UNIFIED
    """A prefill instance answers one token and the KV's whereabouts; a decode instance takes requests whose KV
    arrives from one (see :mod:`hetsched.simworker.roles`)."""
    slowdown_prefill: float = 1.0
    """Each step's prefill share runs this many times as long as the step model says: a device whose catalog
    figures are wrong (see :mod:`hetsched.perf.correction`), for testing recalibration without hardware."""
    slowdown_decode: float = 1.0
    """The same for each step's decode share."""
    tail: Tail | None = None
    """Step dispersion and a front end (see :mod:`hetsched.perf.tail`), as learned from an engine; None: steps
    take the model's time and requests and tokens pass at once."""
    seed: int = 0
    """Seeds the dispersion's draws."""
    prefix_caching: bool = True
    """Cache prompt blocks by their hashes, as vLLM v1 does by default (``--no-prefix-caching``: off)."""
    hash_algorithm: HashAlgorithm = HashAlgorithm.SHA256
    """vLLM's ``--prefix-caching-hash-algo``."""
    hash_seed: str = DEFAULT_SEED
    """The block hashes' seed: an engine's ``PYTHONHASHSEED`` where set (see :mod:`hetsched.kvcache.hashing`)."""
    tokenizer: str | None = None
    """Directory of the model's ``tokenizer.json`` (and chat template); None: four bytes of text a token."""
    kv_events: str | None = None
    """ZMQ address the KV events are published on (``tcp://127.0.0.1:5557``); None: not published."""
    kv_events_replay: str | None = None
    """ZMQ address of the replay socket; None: none."""
    kv_events_topic: str = ""
    """Topic of each published batch."""

    @property
    def slowdown(self) -> StepCorrection:
        """The slowdown as a correction over the step model (identity when both factors are 1)."""
        return StepCorrection(prefill_scale=self.slowdown_prefill, decode_scale=self.slowdown_decode)


def hash_seed_from_env() -> str:
    """The seed an engine in this environment hashes blocks with: ``PYTHONHASHSEED`` where set, as vLLM reads it."""
    return os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)


def build_engine(spec: WorkerSpec, device: Device | None = None, *,
                 publisher: KVEventPublisher | None = None) -> tuple[SimEngine, VllmMetrics]:
    """The simulated engine and its metrics; InfeasibleError when the model does not fit. ``publisher`` takes
    each step's KV events."""
    arch = load_model(spec.model)
    device = device or host_catalog().device(spec.accelerator)
    memory = fit(arch, device, tp=spec.tp, engine=spec.engine, context_len=spec.max_model_len)
    if not memory.fits:
        raise InfeasibleError(f"{spec.model} does not fit {device.id} at TP={spec.tp}: {memory.reason}")
    num_blocks = spec.kv_blocks or memory.max_kv_tokens // spec.engine.block_size
    metrics = VllmMetrics(model_name=spec.served_name or spec.model, block_size=spec.engine.block_size,
                          num_blocks=num_blocks, max_model_len=spec.max_model_len,
                          prefix_caching=spec.prefix_caching, hash_algorithm=str(spec.hash_algorithm))
    step_model = corrected(RooflineModel(arch, device, tp=spec.tp, engine=spec.engine, constants=spec.perf),
                           spec.slowdown)
    engine = SimEngine(step_model, engine=spec.engine,
                       num_blocks=num_blocks, max_model_len=spec.max_model_len, time_scale=spec.time_scale,
                       min_step_wall_s=spec.min_step_wall_s, request_overhead_s=spec.request_overhead_ms / 1e3,
                       observer=metrics, tail=spec.tail, seed=spec.seed, prefix_caching=spec.prefix_caching,
                       kv_events=publisher.publish if publisher is not None else None)
    return engine, metrics


def _error(status: int, message: str, *, type: ErrorType, param: str | None = None,
           code: str | None = None) -> Response:
    return Response(error_body(message, type=type, param=param, code=code), status_code=status,
                    media_type="application/json")


def _text(index: int) -> str:
    return " " + WORDS[index % len(WORDS)]


class SimWorker:
    """The HTTP face of one :class:`SimEngine`."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.name = spec.served_name or spec.model
        device = host_catalog().device(spec.accelerator)
        self.publisher = None if spec.kv_events is None else \
            KVEventPublisher(spec.kv_events, replay_endpoint=spec.kv_events_replay, topic=spec.kv_events_topic)
        self.engine, self.metrics = build_engine(spec, device, publisher=self.publisher)
        self.role_play = RolePlay(spec.role, load_model(spec.model), device.accelerator.network_gbs,
                              spec.engine.block_size, tp=spec.tp)
        self.tokenizer = None if spec.tokenizer is None else PromptTokenizer.load(spec.tokenizer, field="tokenizer")
        self.hashing = BlockHashing(spec.engine.block_size, spec.hash_algorithm, spec.hash_seed)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.publisher is not None:
            self.publisher.start()
        self.engine.start()
        try:
            yield
        finally:
            await self.engine.stop()
            if self.publisher is not None:
                await self.publisher.close()

    def prompt(self, request: OpenAIRequest) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """The prompt's length, its token ids and its full blocks' hashes (both empty when neither a prefix cache
        nor a tokenizer needs them); TokenizeError when the tokenizer refuses it."""
        if not self.spec.prefix_caching and self.tokenizer is None:
            return prompt_tokens(request), (), ()
        token_ids = tuple(prompt_token_ids(request, self.tokenizer))
        hashes = tuple(self.hashing.block_hashes(token_ids)) if self.spec.prefix_caching else ()
        return len(token_ids), token_ids, hashes

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, ApiKind.COMPLETIONS)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, ApiKind.CHAT)

    async def _serve(self, request: Request, kind: ApiKind) -> Response:
        try:
            parsed = parse_request(await request.body(), kind)
            if parsed.model != self.name:
                return _error(404, f"the model {parsed.model!r} does not exist; this server serves {self.name!r}",
                              type=ErrorType.NOT_FOUND, param="model", code="model_not_found")
            n_prompt, token_ids, block_hashes = self.prompt(parsed)
            admission = self.role_play.admit(prompt_tokens=n_prompt, max_tokens=max_tokens(parsed),
                                         params=parsed.kv_transfer_params)
            n_out = admission.max_tokens
            self.engine.check(n_prompt, n_out)
        except InputError as exc:
            return _error(400, str(exc), type=ErrorType.INVALID_REQUEST, param=exc.field)
        except HetschedError as exc:
            return _error(400, str(exc), type=ErrorType.INVALID_REQUEST)
        self.metrics.on_admitted(n_prompt)
        meta = _Meta(kind, self.name, n_prompt)
        tokens = _Choices([self.engine.generate(n_prompt, n_out, cached_tokens=admission.cached_tokens,
                                                delay_s=admission.delay_s, block_hashes=block_hashes,
                                                token_ids=token_ids) for _ in range(parsed.n)])
        if parsed.stream:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            return StreamingResponse(self._stream(tokens, meta, n_out, include_usage=include_usage),
                                     media_type="text/event-stream")
        if admission.hands_off:
            host, port = request.scope.get("server") or ("127.0.0.1", 0)
            meta.kv_transfer_params = self.role_play.handoff(prompt_tokens=n_prompt, request_id=meta.id,
                                                             host=host, port=port)
        return await self._complete(tokens, meta, request.receive)

    async def _stream(self, tokens: _Choices, meta: _Meta, n_out: int, *,
                      include_usage: bool) -> AsyncIterator[bytes]:
        sent = [0] * len(tokens.streams)
        try:
            async for choice, produced in tokens:
                events = [sse_event(meta.role_chunk(choice))] if sent[choice] == 0 and meta.kind is ApiKind.CHAT \
                    else []
                while sent[choice] < produced:
                    events.append(sse_event(meta.chunk(sent[choice], last=sent[choice] + 1 == n_out, choice=choice)))
                    sent[choice] += 1
                yield b"".join(events)
        except HetschedError as exc:
            yield sse_event({"error": {"message": str(exc), "type": str(ErrorType.INVALID_REQUEST)}})
        finally:
            await tokens.aclose()
        if include_usage:
            yield sse_event(meta.usage_chunk(sum(sent)))
        yield sse_event("[DONE]")

    async def _complete(self, tokens: _Choices, meta: _Meta, receive: Receive) -> Response:
        async def drain() -> list[int]:
            produced = [0] * len(tokens.streams)
            async for choice, count in tokens:
                produced[choice] = count
            return produced

        work = asyncio.create_task(drain())
        gone = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                await tokens.aclose()
        if not work.done() or work.cancelled():
            return Response(status_code=499)
        try:
            produced = work.result()
        except HetschedError as exc:
            return _error(400, str(exc), type=ErrorType.INVALID_REQUEST)
        return JSONResponse(meta.full(produced))

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.name, "object": "model", "created": 0, "owned_by": "hetsched",
            "root": self.spec.model, "max_model_len": self.spec.max_model_len}]})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``, counting as the twin does (the model's tokenizer, else four bytes a token), so
        clients that measure lengths in the server's tokens (the endpoint profiler) can measure the twin too;
        without a tokenizer the ids need only be stable."""
        try:
            prompt = parse_json(await request.body(), name="request body", field="body").get("prompt")
        except (InputError, AttributeError):
            prompt = None
        if not isinstance(prompt, str):
            return _error(400, "expected a JSON object with a text prompt", type=ErrorType.INVALID_REQUEST,
                          param="prompt")
        if self.tokenizer is not None:
            try:
                tokens = self.tokenizer.encode(prompt, add_special_tokens=True)
            except InputError as exc:
                return _error(400, str(exc), type=ErrorType.INVALID_REQUEST, param=exc.field)
        else:
            tokens = [token % TOKEN_IDS for token in text_token_ids(prompt)] if prompt else []
        return JSONResponse({"count": len(tokens), "max_model_len": self.spec.max_model_len, "tokens": tokens,
                             "token_strs": None})

    async def kv_lookup(self, request: Request) -> Response:
        """How many tokens of a ``/v1/completions`` body's prompt the prefix cache holds now, found as admission
        finds them (the worker's tokens and block hashes, the longest cached run short of the last token): a client
        can route on the caches exactly (a benchmark's oracle). The cache is only read."""
        try:
            n_prompt, _, block_hashes = self.prompt(parse_request(await request.body(), ApiKind.COMPLETIONS))
        except InputError as exc:
            return _error(400, str(exc), type=ErrorType.INVALID_REQUEST, param=exc.field)
        hit, _ = self.engine.scheduler.prefix_hit(block_hashes, n_prompt)
        return JSONResponse({"prompt_tokens": n_prompt, "cached_tokens": hit * self.spec.engine.block_size})

    async def health(self, request: Request) -> Response:
        """200 while the engine loop runs; 503 naming its error once it died, as a dead vLLM engine core is."""
        failure = self.engine.failure
        if failure is not None:
            return JSONResponse({"error": {"message": f"the engine loop died: {failure}",
                                           "type": "service_unavailable"}}, status_code=503)
        return Response(status_code=200)

    async def prometheus(self, request: Request) -> Response:
        self.metrics.on_step(self.engine)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _outside_api(path: str) -> bool:
    return not path.startswith("/v1/")


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Choices:
    """The ``n`` sequences of one request (OpenAI's ``n``), as vLLM runs them: each its own engine request; yields
    (choice, tokens it has so far) as any grows, and closing it cancels those still running."""

    def __init__(self, streams: list[AsyncGenerator[int, None]]) -> None:
        self.streams = streams
        self._tasks: list[asyncio.Task[None]] = []

    async def __aiter__(self) -> AsyncIterator[tuple[int, int]]:
        if len(self.streams) == 1:  # the common case needs no tasks
            async for produced in self.streams[0]:
                yield 0, produced
            return
        queue: asyncio.Queue[tuple[int, int] | BaseException | None] = asyncio.Queue()

        async def pump(choice: int, stream: AsyncIterator[int]) -> None:
            try:
                async for produced in stream:
                    queue.put_nowait((choice, produced))
            except HetschedError as exc:
                queue.put_nowait(exc)
            queue.put_nowait(None)

        self._tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        running = len(self._tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for stream in self.streams:
            await stream.aclose()


class _Meta:
    """OpenAI response shapes for one request."""

    def __init__(self, kind: ApiKind, model: str, prompt_tokens: int) -> None:
        self.kind, self.model, self.prompt_tokens = kind, model, prompt_tokens
        prefix = "chatcmpl" if kind is ApiKind.CHAT else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.kv_transfer_params: dict[str, Any] | None = None
        """A prefill instance's handoff to the decode side, answered beside the completion as vLLM does."""

    def _envelope(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def chunk(self, index: int, *, last: bool, choice: int = 0) -> dict[str, Any]:
        finish = "length" if last else None
        if self.kind is ApiKind.CHAT:
            return {**self._envelope("chat.completion.chunk"), "choices": [
                {"index": choice, "delta": {"content": _text(index)}, "logprobs": None, "finish_reason": finish}]}
        return {**self._envelope("text_completion"),
                "choices": [{"index": choice, "text": _text(index), "logprobs": None, "finish_reason": finish}]}

    def role_chunk(self, choice: int = 0) -> dict[str, Any]:
        """vLLM's first chat event of each choice: the role and empty content, sent with its first token."""
        return {**self._envelope("chat.completion.chunk"), "choices": [
            {"index": choice, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]}

    def usage(self, produced: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": produced,
                "total_tokens": self.prompt_tokens + produced}

    def usage_chunk(self, produced: int) -> dict[str, Any]:
        object_ = "chat.completion.chunk" if self.kind is ApiKind.CHAT else "text_completion"
        return {**self._envelope(object_), "choices": [], "usage": self.usage(produced)}

    def full(self, produced: list[int]) -> dict[str, Any]:
        """The whole answer: one choice per sequence, usage summed over them as vLLM does."""
        texts = ["".join(_text(i) for i in range(count)) for count in produced]
        handoff = {} if self.kv_transfer_params is None else {"kv_transfer_params": self.kv_transfer_params}
        if self.kind is ApiKind.CHAT:
            choices: list[dict[str, Any]] = [{"index": i, "message": {"role": "assistant", "content": text},
                                              "logprobs": None, "finish_reason": "length"}
                                             for i, text in enumerate(texts)]
            return {**self._envelope("chat.completion"), "choices": choices, "usage": self.usage(sum(produced)),
                    **handoff}
        return {**self._envelope("text_completion"), "usage": self.usage(sum(produced)),
                "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": "length"}
                            for i, text in enumerate(texts)], **handoff}


def create_worker_app(spec: WorkerSpec, *, api_key: str | None = None,
                      limits: ServerLimits = ServerLimits()) -> Starlette:
    """The simulated worker as an ASGI app; ``app.state.worker`` is the :class:`SimWorker`.

    Like vLLM's ``--api-key``, ``api_key`` guards the ``/v1`` routes only: ``/metrics`` and ``/health`` stay open
    to the router and the autoscaler.
    """
    worker = SimWorker(spec)
    app = Starlette(routes=[
        Route("/v1/completions", worker.completions, methods=["POST"]),
        Route("/v1/chat/completions", worker.chat, methods=["POST"]),
        Route("/v1/models", worker.models, methods=["GET"]),
        Route("/tokenize", worker.tokenize, methods=["POST"]),
        Route("/kv/lookup", worker.kv_lookup, methods=["POST"]),
        Route("/health", worker.health, methods=["GET"]),
        Route("/metrics", worker.prometheus, methods=["GET"]),
    ], middleware=[Middleware(Guard, limits=limits, render=refusal_body, token=api_key, public=_outside_api)],
        lifespan=worker.lifespan)
    app.state.worker = worker
    return app
