"""What both schedulers share: the draft length policy by running requests (the schedulers'
slots, queue, cancel and stop are tested through each: test_scheduler.py, test_llmapi.py)."""

from __future__ import annotations

import pytest

from trtspec.serve.slots import DraftPolicy


def test_draft_length_policy_follows_the_running_count() -> None:
    policy = DraftPolicy.parse("1:4,4:2,8:0")
    assert [policy.for_running(n) for n in (1, 2, 4, 5, 8, 9)] == [4, 2, 2, 0, 0, 0]
    assert DraftPolicy(3).for_running(50) == 3
    for bad in ("", "4", "1:4,1:2", "4:2,1:4", "0:3", "1:-1", "a:b"):
        with pytest.raises(ValueError, match="draft length schedule"):
            DraftPolicy.parse(bad)
