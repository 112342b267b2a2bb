"""The OpenAI wire format `trtspec serve` speaks: request schemas, error bodies, and text that
streams token by token with stop strings.

Requests are validated here (types, ranges, n = 1, roles) so the server answers every bad
request with an OpenAI-style error body and the right status, never a 500.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

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
    do (clients send user, logit_bias …); the ones that would change results are refused."""

    model_config = ConfigDict(extra="ignore", strict=False)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="extension; 0 or -1 = off")
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension, as in vLLM
    logprobs: Any = None
    best_of: int | None = Field(None, ge=1, le=1)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        if value not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return value

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    echo: bool = False

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

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
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


def first_error(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """A validation error as (message, param) for the error body."""
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    where = ".".join(loc) or None
    msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
    return (f"{where}: {msg}" if where else msg), where


class TextStream:
    """Token ids in, text out, as a client should see it: a trailing partial UTF-8 character
    and any tail that could start a stop string are held back until they resolve; a stop
    string ends the text just before it (the stop string itself is not returned)."""

    def __init__(self, decode: Any, stops: Sequence[str] = ()) -> None:
        self.decode, self.stops = decode, list(stops or ())
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already returned
        self.stopped = False
        self.tokens_used = 0  # after a stop: the tokens up to the one that completed it

    def push(self, token_ids: Sequence[int]) -> str:
        """New text to send; sets ``stopped`` when a stop string appeared."""
        if self.stopped:
            return ""
        self.ids += token_ids
        text = self.decode(self.ids)
        hits = [i for s in self.stops if (i := text.find(s, max(0, self.sent - len(s)))) >= 0]
        if hits:
            self.stopped = True
            self.tokens_used = next(k for k in range(1, len(self.ids) + 1) if any(
                s in self.decode(self.ids[:k]) for s in self.stops))
            return self._take(text, min(hits))
        safe = len(text) - (1 if text.endswith("\ufffd") else 0)
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return self._take(text, safe)

    def flush(self) -> str:
        """The rest, once the request has finished without a stop string."""
        return "" if self.stopped else self._take(self.decode(self.ids), None)

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else max(end, self.sent)
        out, self.sent = text[self.sent: end], end
        return out
