"""One request of a workload, and custom workloads as JSONL files of them: what every loader
(the built-in set, SPEED-Bench, JSONL) produces, apart from the loaders so that each imports only
this."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class WorkloadError(ValueError):
    """A workload that cannot be used (one line, names the file and line)."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    role: str
    content: str


class WorkloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    category: str = "default"
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    max_tokens: int | None = Field(None, ge=1)
    followups: tuple[str, ...] = ()  # later user turns of a multi-turn request
    source: str = "custom"
    copy_of: str | None = None  # --repeat: the id of the request this one measures again

    @model_validator(mode="after")
    def _one_prompt(self) -> WorkloadRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self

    def chat(self) -> str | list[dict[str, str]]:
        """What trtspec.runtime.models.encode takes: text, or messages as dicts."""
        if self.messages is not None:
            return [m.model_dump() for m in self.messages]
        assert self.prompt is not None
        return self.prompt


def load_jsonl(path: str | Path) -> list[WorkloadRequest]:
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"{path}: no such workload file")
    requests, seen = [], set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            request = WorkloadRequest.model_validate(json.loads(line))
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{path}:{number}: not JSON ({e.msg})") from None
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(map(str, err["loc"])) or "request"
            msg = err["msg"].removeprefix("Value error, ")
            raise WorkloadError(f"{path}:{number}: {where}: {msg}") from None
        if request.id in seen:
            raise WorkloadError(f"{path}:{number}: id '{request.id}' appears twice")
        seen.add(request.id)
        requests.append(request)
    if not requests:
        raise WorkloadError(f"{path}: no requests")
    return requests
