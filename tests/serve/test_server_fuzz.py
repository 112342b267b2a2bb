"""`trtspec serve` fuzzed over HTTP from its own OpenAPI schema (schemathesis: bodies that
follow the schema and bodies that break it, for every operation; a bounded, seeded count, on
127.0.0.1 only): no 5xx, no request left hanging, the running and waiting gauges back to 0."""

from __future__ import annotations

import time

import pytest
import requests
from test_server import metric, serving, tiny_dir, tiny_engine  # noqa: F401  (a fixture)

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = 40  # per operation and generation mode


def test_fuzzing_the_api_finds_no_5xx_and_leaves_nothing_running(tiny_dir) -> None:  # noqa: F811
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    served = tiny_engine(tiny_dir)
    seen: dict[int, int] = {}
    with serving(served) as url:
        root = url.removesuffix("/v1")
        schema = schemathesis.openapi.from_url(f"{root}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions",
                                                  "/v1/models", "/health", "/metrics"}
        session = requests.Session()
        for op in operations:
            for mode in schemathesis.GenerationMode:

                @given(case=op.as_strategy(generation_mode=mode))
                @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                          database=None, suppress_health_check=list(HealthCheck))
                def call(case) -> None:
                    response = case.call(base_url=root, session=session, timeout=30)
                    seen[response.status_code] = seen.get(response.status_code, 0) + 1
                    assert response.status_code < 500, (case.method, case.path, case.body,
                                                         response.text[:300])

                try:
                    call()
                except Unsatisfiable:  # nothing to break: an operation without a body
                    assert mode == schemathesis.GenerationMode.NEGATIVE and not op.body
        deadline = time.time() + 20
        while time.time() < deadline and (metric(url, "trtspec:num_requests_running")
                                          or metric(url, "trtspec:num_requests_waiting")):
            time.sleep(0.05)
        assert metric(url, "trtspec:num_requests_running") == 0
        assert metric(url, "trtspec:num_requests_waiting") == 0
        assert requests.get(f"{root}/health", timeout=5).status_code == 200
    assert seen.get(200, 0) > 20 and seen.get(400, 0) > 40, seen  # both kinds reached
