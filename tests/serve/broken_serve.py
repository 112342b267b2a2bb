"""`trtspec serve --backend toy ARGS` with a deliberately wrong sampler, for the endpoint
audit's power tests: the CLI as users run it, over HTTP. $TRTSPEC_TEST_BROKEN picks the fault:

* ``temperature``  every request samples at 1.1 × its temperature (a server that scales it)
* ``exact_match``  drafts are accepted when they equal the target's argmax, and the first
                   other token is sampled from the target (``exact_match_verify``)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import trtspec.serve.server as server
import trtspec.spec.executor
from trtspec.cli import main

fault = os.environ["TRTSPEC_TEST_BROKEN"]
if fault == "temperature":
    exact = server.sampling_params

    def hotter(limits, body, prompt_len):
        params = exact(limits, body, prompt_len)
        return params.model_copy(update={"temperature": params.temperature * 1.1})

    server.sampling_params = hotter
elif fault == "exact_match":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from broken_verifiers import exact_match_verify

    trtspec.spec.executor.verify = exact_match_verify
else:
    raise SystemExit(f"unknown fault {fault!r}")
main(["serve", "--backend", "toy", *sys.argv[1:]])
