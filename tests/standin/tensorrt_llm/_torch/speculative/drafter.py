"""``Drafter`` as 1.2.1 has it (tensorrt_llm/_torch/speculative/drafter.py): the constructor's
names, the abstract prepare_draft_tokens, and the lower-bound draft_len_schedule lookup."""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from typing import Any


class Drafter(ABC):
    def __init__(self, max_draft_len: int | None = None, max_total_draft_tokens: int | None = None,
                 max_concurrency: int | None = None,
                 draft_len_schedule: dict[int, int] | None = None) -> None:
        self.max_draft_len = max_draft_len
        self.max_total_draft_tokens = max_total_draft_tokens
        self.max_concurrency = max_concurrency
        self.draft_len_schedule = draft_len_schedule

    @abstractmethod
    def prepare_draft_tokens(self, scheduled_requests: Any, resource_manager: Any = None
                             ) -> None: ...

    def get_draft_len_for_batch_size(self, batch_size: int) -> int:
        """The D of the largest key ≤ batch_size (keys are lower bounds)."""
        if self.draft_len_schedule is None:
            return self.max_draft_len
        keys = sorted(self.draft_len_schedule)
        return self.draft_len_schedule[keys[bisect.bisect_right(keys, batch_size) - 1]]
