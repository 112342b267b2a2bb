"""What a request must pass before any work is done for it: the API key, the body's size (by
its Content-Length before reading, or while a chunked body is read), the prompt's characters
before tokenizing and its tokens after, and max_tokens against the sequence limit; then its
SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trtspec.serve.openai_api import ApiError
from trtspec.spec.sample.probs import SamplingParams

CHARS_PER_TOKEN = 16  # a prompt longer than max_input_len × this cannot fit: refused untokenized


@dataclass
class Limits:
    max_input_len: int = 2048  # prompt tokens
    max_seq_len: int = 4096  # prompt + output tokens
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256
    max_prompt_chars: int | None = None  # None: max_input_len × CHARS_PER_TOKEN

    def prompt_chars(self) -> tuple[int, str]:
        """The bound on a prompt's characters, and where it comes from (for the error)."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars, "max_prompt_chars"
        return (self.max_input_len * CHARS_PER_TOKEN,
                f"max_input_len {self.max_input_len} tokens × {CHARS_PER_TOKEN} characters")


def authorize(request: Any, api_key: str | None) -> None:
    import hmac

    given = request.headers.get("authorization", "").encode()
    if api_key and not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer …)",
                       "authentication_error", code="invalid_api_key")


async def read_body(request: Any, cap: int) -> bytes:
    """The body, refused (413) by its Content-Length before reading, or, sent without one
    (chunked), as soon as more than ``cap`` bytes have come: never more is held."""
    size = request.headers.get("content-length")
    if size and size.isdigit() and int(size) > cap:
        raise ApiError(413, f"body of {size} bytes is over the limit ({cap})")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > cap:
            raise ApiError(413, f"body is over the limit ({cap} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def bound_chars(limits: Limits, chars: int, param: str, what: str) -> None:
    """Refuse a prompt too long to fit before tokenizing it (tokenizing costs time)."""
    cap, why = limits.prompt_chars()
    if chars > cap:
        raise ApiError(400, f"{what} has {chars} characters, over the limit of {cap} ({why})",
                       param=param)


def sampling_params(limits: Limits, body: Any, prompt_len: int) -> SamplingParams:
    """The request's SamplingParams, after its prompt and max_tokens fit the limits (null
    sampling fields are their defaults, as OpenAI's API has them)."""
    if prompt_len > limits.max_input_len:
        raise ApiError(400, f"the prompt has {prompt_len} tokens, over max_input_len "
                            f"({limits.max_input_len})", param="prompt")
    room = limits.max_seq_len - prompt_len
    wanted = body.output_limit or min(limits.default_max_tokens, room)
    if room < 1 or wanted > room:
        raise ApiError(400, f"max_tokens {wanted} + {prompt_len} prompt tokens exceed "
                            f"max_seq_len ({limits.max_seq_len})", param="max_tokens")
    return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p,
                          top_k=max(body.top_k or 0, 0), seed=body.seed, max_tokens=wanted,
                          ignore_eos=body.ignore_eos,
                          stop_token_ids=tuple(body.stop_token_ids or ()))
