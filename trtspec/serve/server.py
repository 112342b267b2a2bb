"""`trtspec serve`: an OpenAI-compatible server (FastAPI + uvicorn) on the scheduler.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (with and without ``stream``),
``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus, with spec-decode
counters named like vLLM's). One thread runs the scheduler's step loop and owns the models;
each HTTP request submits to it and awaits its tokens through an asyncio queue. A response
carries an extension field ``spec`` with the request's counters and AL, and
``metrics.speculative_decoding`` in the shape vLLM gives per request.

Work is bounded before it is done: a body is refused past ``max_body_bytes`` while it is read,
a prompt past its character bound before it is tokenized, and tokenizing runs off the event
loop. A model failure ends every request with an error (an SSE error event in a stream, a 500
otherwise) and the server answers 503 from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from trtspec.serve import openai_api as wire
from trtspec.serve.intake import Limits, authorize, bound_chars, read_body, sampling_params
from trtspec.serve.llmapi import LlmApiScheduler
from trtspec.serve.metrics import AccessLog, ServeMetrics, note, spec_field, speculative_decoding
from trtspec.serve.openai_api import (  # the text side: re-exported for the CLI
    ApiError,
    ChatRequest,
    CompletionRequest,
    IdTexts,
    Texts,
    TextStream,
    TokenizerTexts,
    first_error,
    refuse_unsupported,
)
from trtspec.serve.scheduler import Scheduler
from trtspec.serve.slots import QueueFull, SchedulerDown, Ticket
from trtspec.spec.executor import Delta
from trtspec.spec.sample.probs import SamplingParams

__all__ = ["Engine", "IdTexts", "Limits", "TokenizerTexts", "freeze_heap", "make_app"]


def freeze_heap() -> tuple[int, float]:
    """Collect, then move every object alive now (the models, the compiled graphs and
    their caches: what a server holds for its lifetime) out of the garbage collector's view,
    as vLLM does once it has started. Returns (objects frozen in all, a second call's
    included; seconds the collection before the freeze took, which also frees the warm-up's
    garbage). Why: CPython's full collection walks every tracked object, and a server that
    has compiled its graphs holds hundreds of thousands (on the 2-core CPU, the SmolLM2
    runner compiled and warmed: about 814,000, and a full collection that found no garbage
    took 0.66 s) while the step thread holds the GIL through it, so every stream would wait
    that long whenever enough new objects (a suffix trie's, requests') survived to set one
    off (how often that happens in service was not measured). Frozen, a full pass walks
    only what came after (on the same heap with 200,000 new objects, 7 ms). Collected
    first, so nothing already garbage is kept for good; what is frozen is still freed when
    its last reference goes (only a cycle among frozen objects would outlive its use).
    Once per process, after warm-up: a server's decision, not a library's (tests and
    embedding programs keep their collector as it is)."""
    began = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - began
    gc.freeze()
    return gc.get_freeze_count(), seconds


@dataclass
class Run:
    """One submitted request as the HTTP side sees it: its ticket, its deltas (with their
    text), ``ended`` (set once the step thread is done with it), the (drafted, accepted)
    counts of each round that proposed drafts (for per-request metrics; appended on the step
    thread, complete once ``ended`` is set)."""

    ticket: Ticket
    deltas: AsyncIterator[tuple[Delta, str, str | None]]
    ended: asyncio.Event
    steps: list[tuple[int, int]] = field(default_factory=list)


class Engine:
    """The scheduler's step thread, the text side and the metrics of one served model.

    ``d_mode`` is how D is chosen, for the access log (read off the scheduler's policy);
    ``method`` the speculation method served; ``spec_metrics`` is vLLM's per-request spec-decode
    metrics level: "none", "summary" or "detailed"."""

    def __init__(self, scheduler: Scheduler | LlmApiScheduler, texts: Texts, model: str,
                 limits: Limits, policy: str = "", spec_metrics: str = "summary",
                 method: str = "") -> None:
        from prometheus_client import CollectorRegistry, disable_created_metrics

        disable_created_metrics()  # no *_created series beside each counter (as vLLM)
        self.scheduler, self.texts, self.model, self.limits = scheduler, texts, model, limits
        self.policy, self.spec_metrics, self.method = policy, spec_metrics, method
        self.draining = False
        self.started = int(time.time())  # /v1/models' "created"; set again when serving starts
        self.registry = CollectorRegistry()
        self.metrics = ServeMetrics(self.registry, scheduler)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=scheduler.serve_forever, args=(self._stop,),
                                        name="trtspec-step", daemon=True)

    @property
    def d_mode(self) -> str:
        """The access log's D: plain, METHOD/D4, METHOD/adaptive or METHOD/by-load[…]."""
        policy = self.scheduler.policy
        if not self.scheduler.speculates:
            return "plain"
        if policy.schedule:
            d = "by-load[" + ",".join(f"{n}:{d}" for n, d in policy.schedule) + "]"
        else:
            d = str(policy.draft_len) if policy.adaptive else f"D{policy.draft_len}"
        return f"{self.method}/{d}" if self.method else d

    @property
    def max_draft_len(self) -> int:
        """The most drafts a round may propose (vLLM's ``num_spec_tokens``)."""
        policy = self.scheduler.policy
        ints = [d for d in (policy.draft_len, *(d for _, d in policy.schedule))
                if isinstance(d, int)]
        return max([self.scheduler.draft_len, *ints])

    def start(self) -> None:
        self.started = int(time.time())
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    async def run(self, prompt: list[int], params: SamplingParams, text: TextStream) -> Run:
        """Submit; the run's pieces of text cancel the request if abandoned (a client that
        disconnects frees its slot within one round). The step thread only queues each
        delta: text is made here, on the event loop, as the tokens arrive (O(new tokens)
        each), so detokenizing and stop strings cost the step nothing. A stop string found
        here ends the request at the scheduler's next step (:meth:`Slots.stop`): the client
        never sees what a round made past it, and usage counts the tokens up to it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        ended = asyncio.Event()
        steps: list[tuple[int, int]] = []
        stops = self.scheduler.stops(params)

        def push(delta: Delta) -> None:  # on the step thread: hand over, nothing more
            if delta.num_draft:
                steps.append((delta.num_draft, delta.num_accepted))
            with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
                loop.call_soon_threadsafe(queue.put_nowait, delta)

        try:
            ticket = self.scheduler.submit(prompt, params, push)
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error") from None
        except SchedulerDown as e:
            raise ApiError(503, str(e), "server_error") from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None

        def on_done() -> None:  # on the step thread
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(ended.set)

        ticket.on_done = on_done
        if ticket.done.is_set():  # it ended before on_done was set
            ended.set()

        async def deltas() -> AsyncIterator[tuple[Delta, str, str | None]]:
            try:
                while True:
                    delta = await queue.get()
                    ids, end = delta.token_ids, delta.finish_reason
                    if end == "stop" and ids and ids[-1] in stops:  # a stop token's own text
                        ids = ids[:-1]  # is not sent (as vLLM)
                    try:
                        piece = text.push(ids)
                        if text.stopped:  # a stop string: the request keeps the tokens up
                            end = "stop"  # to it (ended at the scheduler's next step)
                            self.scheduler.stop(ticket, text.tokens_used)
                        elif end == "error":
                            piece = ""
                        elif end is not None:
                            piece += text.flush()
                    except Exception as e:  # the text side failed: this request ends
                        logging.getLogger("trtspec.serve").error(
                            "making a request's text failed (%s: %s): the request is ended",
                            type(e).__name__, e)
                        self.scheduler.cancel(ticket, "error")
                        piece, end = "", "error"
                    yield delta, piece, end
                    if end is not None:
                        return
            finally:
                if not ticket.done.is_set():
                    self.scheduler.cancel(ticket)

        return Run(ticket, deltas(), ended, steps)


def make_app(engine: Engine, api_key: str | None = None) -> Any:
    """The FastAPI application; the engine's step thread starts and stops with it."""
    from contextlib import asynccontextmanager

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.draining = True
            engine.stop()

    app = FastAPI(title="trtspec", lifespan=lifespan)
    app.add_middleware(AccessLog, d_mode=lambda: engine.d_mode)
    bodies = {CompletionRequest: "/v1/completions", ChatRequest: "/v1/chat/completions"}

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, with the request bodies the endpoints read themselves (bounded
        reads, checks in order) declared from the same pydantic models: /docs and API
        fuzzers see what is accepted."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model, path in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                body["properties"]["model"] = {"type": "string", "enum": [engine.model],
                                               "description": "the one model served here"}
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {
                        "$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(404)
    async def not_found(request: Request, _: Exception) -> JSONResponse:
        return JSONResponse(ApiError(404, f"no route {request.url.path}").body(), 404)

    @app.exception_handler(405)
    async def not_allowed(request: Request, _: Exception) -> JSONResponse:
        return JSONResponse(ApiError(405, f"{request.method} is not allowed on "
                                          f"{request.url.path}").body(), 405)

    @app.exception_handler(Exception)
    async def bug(_: Request, e: Exception) -> JSONResponse:  # a trtspec bug, said so
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}",
                                     "server_error").body(), 500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine.draining or engine.scheduler.error else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request, api_key)
        return {"object": "list", "data": [{"id": engine.model, "object": "model",
                                            "created": engine.started, "owned_by": "trtspec"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        body = await _body(request, engine, api_key, CompletionRequest)
        if isinstance(body.prompt, list):
            prompt = body.prompt
        else:
            bound_chars(engine.limits, len(body.prompt), "prompt", "the prompt")
            prompt = await asyncio.to_thread(engine.texts.encode, body.prompt)
        return await _generate(engine, body, prompt, chat=False, request=request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Any:
        body = await _body(request, engine, api_key, ChatRequest)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        bound_chars(engine.limits, sum(len(m["content"]) for m in messages), "messages",
                     "the messages")
        try:
            prompt = await asyncio.to_thread(engine.texts.encode_chat, messages)
        except ApiError:
            raise
        except Exception as e:  # a template that refuses these messages (roles, order)
            raise ApiError(400, f"the chat template refused these messages: {e}",
                           param="messages") from None
        return await _generate(engine, body, prompt, chat=True, request=request)

    return app


async def _body(request: Any, engine: Engine, api_key: str | None, schema: type) -> Any:
    from pydantic import ValidationError

    authorize(request, api_key)
    if engine.draining or engine.scheduler.error:
        why = f"the model failed: {engine.scheduler.error}" if engine.scheduler.error else \
            "the server is shutting down"
        raise ApiError(503, why, "server_error")
    raw = await read_body(request, engine.limits.max_body_bytes)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the body is not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        body = schema.model_validate(data)
    except ValidationError as e:
        message, param = first_error(e.errors())
        raise ApiError(400, message, param=param) from None
    refuse_unsupported(data)
    if body.model != engine.model:
        raise ApiError(404, f"model '{body.model}' is not served here (this server serves "
                            f"'{engine.model}')", code="model_not_found", param="model")
    return body


async def _generate(engine: Engine, body: Any, prompt: list[int], chat: bool,
                    request: Any) -> Any:
    params = sampling_params(engine.limits, body, len(prompt))
    note(request, prompt=len(prompt))
    text = TextStream(engine.texts.decode, body.stop)
    sent = time.perf_counter()
    run = await engine.run(prompt, params, text)
    ticket = run.ticket
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    times: list[float] = []  # when tokens arrived (one entry per step that brought some)

    async def pieces() -> AsyncIterator[tuple[str, str | None]]:
        """(text, finish_reason) as the request runs; ends with the finish reason ("error"
        when the model failed: then the text is dropped)."""
        async for delta, piece, end in run.deltas:
            if delta.token_ids:
                times.append(time.perf_counter())
            if end is not None:
                yield piece, end
                return
            if piece:
                yield piece, None

    async def finish(reason: str) -> dict[str, Any]:
        """Usage, once the step thread is done with the request (its counters settled: at
        its next step after a stop string, else at once). After a stop string, the tokens up
        to the one that completed it count: the scheduler keeps just those."""
        with contextlib.suppress(asyncio.TimeoutError):  # (TimeoutError from 3.11)
            await asyncio.wait_for(run.ended.wait(), timeout=30)
        tokens = len(ticket.token_ids)
        if text.stopped:  # the request may have ended on its own before the stop reached it
            tokens = min(tokens, text.tokens_used)
        note(request, completion=tokens, finish=reason)
        if reason != "error":
            engine.metrics.latency(times[0] if times else None, times[-1] if times else None,
                                   tokens, sent)
        return {"prompt_tokens": len(prompt), "completion_tokens": tokens,
                "total_tokens": len(prompt) + tokens}

    def extensions() -> dict[str, Any]:
        """``spec`` (trtspec's counters) and vLLM's per-request ``metrics`` object."""
        out: dict[str, Any] = {"spec": spec_field(ticket.stats)}
        if engine.spec_metrics != "none":
            spec = None if not engine.scheduler.speculates else speculative_decoding(
                run.steps, engine.max_draft_len, engine.spec_metrics == "detailed")
            out["metrics"] = {"speculative_decoding": spec}
        return out

    def failed() -> ApiError:
        why = f"the model failed: {engine.scheduler.error}" if engine.scheduler.error else \
            f"this request failed on the server: {ticket.error}" if ticket.error else \
            "this request failed on the server (see its log)"
        return ApiError(500, why, "server_error")

    if not body.stream:
        watcher = asyncio.create_task(_cancel_on_disconnect(request, engine, ticket))
        out, reason = [], "length"
        try:
            async for piece, end in pieces():
                out.append(piece)
                reason = end or reason
        finally:
            watcher.cancel()
        usage = await finish(reason)
        if reason == "error":
            raise failed()
        return JSONResponse(wire.completion(rid, chat, engine.model, "".join(out), reason,
                                            usage=usage, **extensions()))

    # with a usage chunk at the end, every other chunk says "usage": null (as OpenAI)
    nulls = {"usage": None} if body.stream_options and body.stream_options.include_usage \
        else None

    async def stream() -> AsyncIterator[str]:
        first = True
        try:
            async for piece, end in pieces():
                if end == "error":
                    await finish(end)
                    yield wire.sse(failed().body())
                    break
                if piece or first or end:
                    yield wire.chunk(rid, chat, engine.model,
                                     [wire.delta(chat, piece, end, first)], **(nulls or {}))
                    first = False
                if end is not None:
                    usage = await finish(end)
                    if nulls is not None:
                        yield wire.chunk(rid, chat, engine.model, [], usage=usage,
                                         **extensions())
        except Exception as e:  # a trtspec bug mid-stream: said so, and the stream still ends
            note(request, finish="error")
            yield wire.sse(ApiError(500, f"internal error: {type(e).__name__}: {e}",
                                    "server_error").body())
        yield wire.DONE

    return _Stream(stream(), lambda: ticket.done.is_set() or engine.scheduler.cancel(ticket))


class _Stream(StreamingResponse):
    """An SSE response that cancels its request however the response ends: a client that
    leaves before the first chunk never starts the body's generator, whose own cleanup would
    then never run."""

    def __init__(self, body: AsyncIterator[str], on_close: Any) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _cancel_on_disconnect(request: Any, engine: Engine, ticket: Ticket) -> None:
    """A non-streaming client that hangs up frees its slot too (a stream notices by itself)."""
    while not ticket.done.is_set():
        if await request.is_disconnected():
            engine.scheduler.cancel(ticket)
            return
        await asyncio.sleep(0.1)

