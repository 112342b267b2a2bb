"""`trtspec serve --backend toy ARGS` whose target runner raises on its N-th score call and
every later one (N = $TRTSPEC_TEST_FAIL_AT; each call takes 10 ms), for the failure test: the
CLI as users run it, with a model that fails mid-round. Prints ``failed at <time.time()>`` to
stderr when it first raises."""

from __future__ import annotations

import os
import sys
import time

import trtspec.cli.serve as cli_serve
from trtspec.cli import main

fail_at = int(os.environ["TRTSPEC_TEST_FAIL_AT"])
make = cli_serve.toy_engine


def faulty_engine(*args, **kwargs):
    engine = make(*args, **kwargs)
    target = engine.scheduler.executor.target
    score, calls = target.score, [0]

    def score_or_fail(tokens, last_only=False):
        calls[0] += 1
        time.sleep(0.01)
        if calls[0] >= fail_at:  # from then on, as a lost device: a failure one row causes
            if calls[0] == fail_at:  # alone ends just that request (tests/serve/test_scheduler)
                print(f"failed at {time.time()}", file=sys.stderr, flush=True)
            raise RuntimeError("CUDA error: an illegal memory access was encountered (test)")
        return score(tokens, last_only)

    target.score = score_or_fail
    return engine


cli_serve.toy_engine = faulty_engine
main(["serve", "--backend", "toy", *sys.argv[1:]])
