"""The OpenAI wire format `trtspec serve` speaks: request schemas, the fields it refuses, error
bodies, response bodies and SSE chunks; and the text side: token ids ↔ text for a model
(:class:`Texts`) and text that streams token by token with stop strings (:class:`TextStream`).

Requests are validated here (types, ranges, roles, fields that would change the result but are
not implemented) so the server answers every bad request with an OpenAI-style error body and
the right status, never a 500, and never a silently different answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ApiError(Exception):
    """An error a client caused (or a server state it should retry): status + OpenAI body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI-compatible servers
    do (clients send ``user``, ``metadata`` …); those that would change the result are refused
    by :func:`refuse_unsupported` unless they hold their default."""

    model_config = ConfigDict(extra="ignore", strict=False)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0, description="null = 1")
    top_p: float | None = Field(1.0, gt=0.0, le=1.0, description="null = 1")
    top_k: int | None = Field(0, ge=-1, description="extension; 0, -1 or null = off")
    stop_token_ids: list[int] | None = None  # extension, as in vLLM
    seed: int | None = Field(None, ge=-(2**63), lt=2**64,
                             description="torch's range; out of it: 400, not a failure")
    stop: str | list[str] | None = Field(None, validate_default=True)
    n: int | None = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension, as in vLLM

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            if len(value) != 1:
                raise ValueError("one prompt per request (n = 1): send a string")
            value = value[0]
        if not value:
            raise ValueError("prompt is empty")
        return value


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)


# Fields that would change the result and are not implemented, with the values that mean
# "not used" (a client library may send a field's default explicitly: that is accepted).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "response_format": (None, {"type": "text"}), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"),
    # vLLM's sampling extensions: a vLLM client may send them, and ignoring one would give
    # another answer than it asked for
    "min_p": (None, 0), "repetition_penalty": (None, 1), "min_tokens": (None, 0),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "prompt_logprobs": (None,), "use_beam_search": (None, False),
    "length_penalty": (None, 1), "allowed_token_ids": (None,), "bad_words": (None, []),
    "logits_processors": (None,), "structured_outputs": (None,),
    "truncate_prompt_tokens": (None,), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
}


def refuse_unsupported(data: Mapping[str, Any]) -> None:
    """400 naming the first field that asks for something trtspec does not do (n > 1,
    penalties, logprobs, tools, JSON mode …): answering without it would be another answer
    than the one the client asked for."""
    for name, defaults in UNSUPPORTED.items():
        value = data.get(name)
        if not any(_same(value, d) for d in defaults):
            allowed = " or ".join(json.dumps(d) for d in defaults if d is not None)
            shown = json.dumps(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "…"
            raise ApiError(400, f"{name} = {shown} is not supported by trtspec serve: leave "
                                f"{name} out (or send {allowed})", param=name)


def _same(value: Any, default: Any) -> bool:
    """``value`` is ``default`` as JSON sees it (0 == 0.0, but false is not 0)."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return bool(value == default)


def first_error(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """A validation error as (message, param) for the error body."""
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    where = ".".join(loc) or None
    msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
    return (f"{where}: {msg}" if where else msg), where


def completion(rid: str, chat: bool, model: str, text: str, reason: str,
               **extra: Any) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion; ``extra``: usage, extensions."""
    choice = ({"message": {"role": "assistant", "content": text}} if chat
              else {"text": text, "logprobs": None})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, **choice, "finish_reason": reason}], **extra}


def delta(chat: bool, piece: str | None, reason: str | None,
          first: bool = False) -> dict[str, Any]:
    """One streamed choice (the first chat delta names the role)."""
    if not chat:
        return {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": reason}
    content: dict[str, Any] = {"role": "assistant"} if first else {}
    if piece:
        content["content"] = piece
    return {"index": 0, "delta": content, "finish_reason": reason}


def chunk(rid: str, chat: bool, model: str, choices: list[dict[str, Any]],
          **extra: Any) -> str:
    """A streamed chunk as an SSE event; without choices, the final usage chunk."""
    return sse({"id": rid, "object": f"{'chat.completion' if chat else 'text_completion'}.chunk",
                "created": int(time.time()), "model": model, "choices": choices, **extra})


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"


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
        from trtspec.runtime.models import encode

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


REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character
UNSETTLED = 3  # trailing U+FFFD held back: an unfinished UTF-8 character shows ≤ 3 of them
REBASE_AFTER = 8  # tokens past the last whole-character boundary before the window is re-cut


class TextStream:
    """Token ids in, text out, as a client should see it, at a cost per push that depends on
    the tokens pushed, not on how far into the stream they come.

    Decoding (the scheme of vLLM's incremental detokenizer): only a window ``ids[prefix:]`` is
    decoded; ``prefix`` is the last point before the previous push where the text ended on a
    whole character. The window keeps tokens already sent before the new ones, so a tokenizer
    that decodes a first token differently (a SentencePiece leading space) changes only text
    already sent; ``sent`` counts the window's characters already taken. A trailing U+FFFD
    may be a character whose other bytes are still to come: up to 3 are held back until they
    come (an unfinished character leaves no more).

    Stop strings: only the new text and the last (longest stop − 1) characters before it are
    scanned; a tail that could start a stop string is held back; a stop string ends the text
    just before it (the stop string itself is not returned) and ``tokens_used`` is the number
    of tokens up to the one that completed it, found by decoding that push's tokens one prefix
    at a time (once per request).
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode, self.stops = decode, [s for s in stops or () if s]
        self.keep = max(map(len, self.stops), default=1) - 1  # text kept to scan across pushes
        self.ids: list[int] = []
        self.prefix = self.read = 0  # the window's start; the last whole-character boundary
        self.sent = 0  # characters of decode(ids[prefix:]) already taken as text
        self.length = 0  # characters taken in all (the settled text)
        self.tail = ""  # the settled text's last ``keep`` characters
        self.held = ""  # settled text not returned yet: it may start a stop string
        self.stopped = False
        self.tokens_used = 0  # after a stop: the tokens up to the one that completed it

    def push(self, token_ids: Sequence[int]) -> str:
        """New text to send; sets ``stopped`` when a stop string appeared."""
        if self.stopped or not token_ids:
            return ""
        start, sent = len(self.ids), self.sent
        self.ids += token_ids
        text = self.decode(self.ids[self.prefix:])
        settled = _settled(text)
        new = text[sent:settled]
        self.sent = max(sent, settled)
        if self.stops and new and self._stop(new, start, sent):
            return self.held
        self._move(text, settled)
        return self._release(new)

    def flush(self) -> str:
        """The rest, once the request has finished without a stop string (an unfinished
        character stays the U+FFFD a whole decode writes)."""
        if self.stopped:
            return ""
        rest = self.held + self.decode(self.ids[self.prefix:])[self.sent:]
        self.held, self.sent = "", self.sent + len(rest) - len(self.held)
        return rest

    def _release(self, new: str) -> str:
        """Take ``new`` settled text; return what cannot start a stop string."""
        self.length += len(new)
        if self.keep:
            self.tail = (self.tail + new)[-self.keep:]
        pending = self.held + new
        hold = next((k for k in range(min(self.keep, len(pending)), 0, -1)
                     if any(s.startswith(pending[-k:]) for s in self.stops)), 0)
        self.held = pending[len(pending) - hold:]
        return pending[: len(pending) - hold]

    def _stop(self, new: str, start: int, sent: int) -> bool:
        """Whether a stop string ends in ``new``; if so, ``held`` becomes the text to send."""
        base = self.length - len(self.tail)  # where tail + new starts in the settled text
        region = self.tail + new
        hits = [(base + i, base + i + len(s)) for s in self.stops
                if (i := region.find(s)) >= 0]
        if not hits:
            return False
        first_end = min(end for _, end in hits)
        self.tokens_used, reached = len(self.ids), self.length + len(new)
        for j in range(start + 1, len(self.ids) + 1):  # the token that completed it
            upto = self.length + _settled(self.decode(self.ids[self.prefix:j])) - sent
            if upto >= first_end:
                self.tokens_used, reached = j, upto
                break
        cut = min(at for at, end in hits if end <= reached)
        released = self.length - len(self.held)
        self.held = (self.held + new)[: cut - released]
        self.stopped = True
        return True

    def _move(self, text: str, settled: int) -> None:
        """Move the window on: to the previous whole-character boundary when this push ended
        on one; else, once the window has gone REBASE_AFTER tokens past the last boundary (pushes
        that keep ending mid-character), to a boundary inside it whose text is all sent."""
        if settled == len(text):
            if self.prefix != self.read:
                self.sent -= len(text) - len(self.decode(self.ids[self.read:]))
            self.prefix, self.read = self.read, len(self.ids)
            return
        if len(self.ids) - self.read <= REBASE_AFTER:
            return
        for cut in range(len(self.ids) - 1, max(self.read, len(self.ids) - REBASE_AFTER), -1):
            if self.decode(self.ids[self.prefix:cut]).endswith(REPLACEMENT):
                continue  # not a whole-character boundary (or not known to be one)
            sent = self.sent - (len(text) - len(self.decode(self.ids[cut:])))
            if sent >= 1:  # the new window's first token is sent (a first-token quirk is moot)
                self.prefix = self.read = cut
                self.sent = sent
                return


def _settled(text: str) -> int:
    """How much of a decoded text is final: all but a trailing run of up to UNSETTLED U+FFFD."""
    run = len(text) - len(text.rstrip(REPLACEMENT))
    return len(text) - min(run, UNSETTLED)
