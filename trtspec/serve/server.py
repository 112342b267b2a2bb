"""`trtspec serve`: an OpenAI-compatible server (FastAPI + uvicorn) on the scheduler.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (with and without ``stream``),
``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus, with spec-decode
counters named like vLLM's). One thread runs the scheduler's step loop and owns the models;
each HTTP request submits to it and awaits its tokens through an asyncio queue. A response
carries an extension field ``spec`` with the request's counters and AL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from trtspec.executor import Delta
from trtspec.sampling import SamplingParams
from trtspec.scheduler import QueueFull, Scheduler, Ticket
from trtspec.serve.metrics import ServeMetrics, spec_field
from trtspec.serve.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    TextStream,
    first_error,
)


class Texts(Protocol):
    """Text ↔ token ids for one model: a tokenizer, or the toy backend's space-separated ids."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class TokenizerTexts:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        from trtspec.models import encode

        return encode(self.tokenizer, messages)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class IdTexts:
    """The toy backend: text is token ids separated by spaces; a chat is its turns' ids."""

    def encode(self, text: str) -> list[int]:
        from trtspec.runtime.toy import parse_token_ids

        try:
            return parse_token_ids(text)
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return [t for m in messages for t in self.encode(m["content"])]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {i}" for i in ids)


@dataclass
class Limits:
    max_input_len: int = 2048  # prompt tokens
    max_seq_len: int = 4096  # prompt + output tokens
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256


class Engine:
    """The scheduler's step thread, the text side and the metrics of one served model."""

    def __init__(self, scheduler: Scheduler, texts: Texts, model: str, limits: Limits,
                 policy: str = "") -> None:
        from prometheus_client import CollectorRegistry, disable_created_metrics

        disable_created_metrics()  # no *_created series beside each counter (as vLLM)
        self.scheduler, self.texts, self.model, self.limits = scheduler, texts, model, limits
        self.policy = policy
        self.draining = False
        self.registry = CollectorRegistry()
        self.metrics = ServeMetrics(self.registry, scheduler)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=scheduler.serve_forever, args=(self._stop,),
                                        name="trtspec-step", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    async def run(self, prompt: list[int], params: SamplingParams
                  ) -> tuple[Ticket, AsyncIterator[Delta]]:
        """Submit; the iterator yields the request's deltas and cancels it if abandoned (a
        client that disconnects frees its slot within one round)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta] = asyncio.Queue()

        def push(delta: Delta) -> None:  # on the step thread
            with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
                loop.call_soon_threadsafe(queue.put_nowait, delta)

        try:
            ticket = self.scheduler.submit(prompt, params, push)
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error") from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None

        async def deltas() -> AsyncIterator[Delta]:
            try:
                while True:
                    delta = await queue.get()
                    yield delta
                    if delta.finish_reason is not None:
                        return
            finally:
                if not ticket.done.is_set():
                    self.scheduler.cancel(ticket)

        return ticket, deltas()


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
        _authorize(request, api_key)
        return {"object": "list", "data": [{"id": engine.model, "object": "model",
                                            "created": 0, "owned_by": "trtspec"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        body = await _body(request, engine, api_key, CompletionRequest)
        prompt = body.prompt if isinstance(body.prompt, list) else \
            engine.texts.encode(body.prompt)
        return await _generate(engine, body, prompt, chat=False, request=request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Any:
        body = await _body(request, engine, api_key, ChatRequest)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt = engine.texts.encode_chat(messages)
        except ApiError:
            raise
        except Exception as e:  # a template that refuses these messages (roles, order)
            raise ApiError(400, f"the chat template refused these messages: {e}",
                           param="messages") from None
        return await _generate(engine, body, prompt, chat=True, request=request)

    return app


def _authorize(request: Any, api_key: str | None) -> None:
    import hmac

    given = request.headers.get("authorization", "").encode()
    if api_key and not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer …)",
                       "authentication_error", code="invalid_api_key")


async def _body(request: Any, engine: Engine, api_key: str | None, schema: type) -> Any:
    from pydantic import ValidationError

    _authorize(request, api_key)
    if engine.draining or engine.scheduler.error:
        why = f"the model failed: {engine.scheduler.error}" if engine.scheduler.error else \
            "the server is shutting down"
        raise ApiError(503, why, "server_error")
    size = request.headers.get("content-length")
    if size and size.isdigit() and int(size) > engine.limits.max_body_bytes:
        raise ApiError(413, f"body of {size} bytes is over the limit "
                            f"({engine.limits.max_body_bytes})")
    raw = await request.body()
    if len(raw) > engine.limits.max_body_bytes:
        raise ApiError(413, f"body is over the limit ({engine.limits.max_body_bytes} bytes)")
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
    if body.model != engine.model:
        raise ApiError(404, f"model '{body.model}' is not served here (this server serves "
                            f"'{engine.model}')", code="model_not_found", param="model")
    return body


def _params(engine: Engine, body: Any, prompt_len: int) -> SamplingParams:
    limits = engine.limits
    if prompt_len > limits.max_input_len:
        raise ApiError(400, f"the prompt has {prompt_len} tokens, over max_input_len "
                            f"({limits.max_input_len})", param="prompt")
    room = limits.max_seq_len - prompt_len
    wanted = body.output_limit or min(limits.default_max_tokens, room)
    if room < 1 or wanted > room:
        raise ApiError(400, f"max_tokens {wanted} + {prompt_len} prompt tokens exceed "
                            f"max_seq_len ({limits.max_seq_len})", param="max_tokens")
    return SamplingParams(temperature=body.temperature, top_p=body.top_p,
                          top_k=max(body.top_k, 0), seed=body.seed, max_tokens=wanted,
                          ignore_eos=body.ignore_eos)


async def _generate(engine: Engine, body: Any, prompt: list[int], chat: bool,
                    request: Any) -> Any:
    params = _params(engine, body, len(prompt))
    text = TextStream(engine.texts.decode, body.stop)
    sent = time.perf_counter()
    ticket, deltas = await engine.run(prompt, params)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    kind = "chat.completion" if chat else "text_completion"
    times: list[float] = []  # when tokens arrived (one entry per step that brought some)

    async def pieces() -> AsyncIterator[tuple[str, str | None]]:
        """(text, finish_reason) as the request runs; ends with the finish reason."""
        async for delta in deltas:
            if delta.token_ids:
                times.append(time.perf_counter())
            piece = text.push(delta.token_ids)
            if text.stopped:  # a stop string: end the request at the next step, say "stop"
                ticket.reported = "stop"
                engine.scheduler.cancel(ticket)
                yield piece, "stop"
                return
            if delta.finish_reason is not None:
                if delta.finish_reason == "error":
                    raise ApiError(500, f"the model failed: {engine.scheduler.error}",
                                   "server_error")
                yield piece + text.flush(), delta.finish_reason
                return
            if piece:
                yield piece, None

    async def finish() -> dict[str, Any]:
        """Usage, once the step thread is done with the request (its counters settled).
        After a stop string, the tokens up to the one that completed it count."""
        await asyncio.get_running_loop().run_in_executor(None, ticket.done.wait, 30.0)
        tokens = text.tokens_used if text.stopped else len(ticket.token_ids)
        engine.metrics.latency(times[0] if times else None, times[-1] if times else None,
                               tokens, sent)
        return {"prompt_tokens": len(prompt), "completion_tokens": tokens,
                "total_tokens": len(prompt) + tokens}

    if not body.stream:
        watcher = asyncio.create_task(_cancel_on_disconnect(request, engine, ticket))
        out, reason = [], "length"
        try:
            async for piece, end in pieces():
                out.append(piece)
                reason = end or reason
        finally:
            watcher.cancel()
        usage = await finish()
        choice = ({"message": {"role": "assistant", "content": "".join(out)}} if chat
                  else {"text": "".join(out), "logprobs": None})
        return JSONResponse({"id": rid, "object": kind, "created": int(time.time()),
                             "model": engine.model,
                             "choices": [{"index": 0, **choice, "finish_reason": reason}],
                             "usage": usage, "spec": spec_field(ticket.stats)})

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(piece: str | None, reason: str | None, first: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if piece:
                delta["content"] = piece
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None,
                      "finish_reason": reason}
        return _sse({"id": rid, "object": f"{kind}.chunk", "created": int(time.time()),
                     "model": engine.model, "choices": [choice]})

    async def stream() -> AsyncIterator[str]:
        first = True
        async for piece, end in pieces():
            if piece or first or end:
                yield chunk(piece, end, first)
                first = False
            if end is not None:
                usage = await finish()
                if include_usage:
                    yield _sse({"id": rid, "object": f"{kind}.chunk",
                                "created": int(time.time()), "model": engine.model,
                                "choices": [], "usage": usage,
                                "spec": spec_field(ticket.stats)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


async def _cancel_on_disconnect(request: Any, engine: Engine, ticket: Ticket) -> None:
    """A non-streaming client that hangs up frees its slot too (a stream notices by itself)."""
    while not ticket.done.is_set():
        if await request.is_disconnected():
            engine.scheduler.cancel(ticket)
            return
        await asyncio.sleep(0.1)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"

