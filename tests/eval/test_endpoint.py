"""Endpoint evals against a tiny OpenAI-compatible SSE server written here (real openai client)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trtspec.eval.endpoint import counter_delta, counter_rates, run_endpoint_eval, scrape
from trtspec.eval.run import read_records, summarize
from trtspec.eval.workloads.request import WorkloadRequest
from trtspec.spec.sample.probs import SamplingParams


def serve(speculative: bool, fail: set[str] = frozenset(), break_off: set[str] = frozenset(),
          cut: set[str] = frozenset()):
    """Streams max_tokens words; a speculative server sends them in bursts of 3 per chunk,
    counts drafts like vLLM (2 of 3 drafts accepted per round) and says D = 3 in the usage
    chunk's per-request metrics. A prompt in ``fail`` gets a
    500 error; one in ``break_off`` gets a chunk, then an SSE error event and [DONE] (what
    trtspec serve sends when the model fails mid-stream); one in ``cut`` gets a chunk and then
    the connection closes."""
    counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            if self.path != "/metrics" or not speculative:
                self.send_error(404)
                return
            body = (f"# TYPE vllm:spec_decode_num_drafts counter\n"
                    f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {counters["drafts"]}\n'
                    f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} '
                    f'{counters["draft_tokens"]}\n'
                    f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} '
                    f'{counters["accepted"]}\n').encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(payload | {"speculative": speculative, "at": time.perf_counter()})
            if payload["messages"][-1]["content"] in fail:
                self.send_response(500)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"error": {"message": "engine died", "type": "server"}}')
                return
            n = payload["max_tokens"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            step = 3 if speculative else 1
            sent = 0

            def emit(obj: dict) -> None:
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                self.wfile.flush()

            if payload["messages"][-1]["content"] in cut:
                emit({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                      "choices": [{"index": 0, "delta": {"content": " w"},
                                   "finish_reason": None}]})
                return
            if payload["messages"][-1]["content"] in break_off:
                emit({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                      "choices": [{"index": 0, "delta": {"content": " w"},
                                   "finish_reason": None}]})
                emit({"error": {"message": "the model failed: RuntimeError: boom",
                                "type": "server_error", "param": None, "code": None}})
                self.wfile.write(b"data: [DONE]\n\n")
                return
            while sent < n:
                k = min(step, n - sent)
                time.sleep(0.004)
                if speculative:
                    counters["drafts"] += 1
                    counters["draft_tokens"] += 3
                    counters["accepted"] += 2
                emit({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                      "choices": [{"index": 0, "delta": {"content": " w" * k},
                                   "finish_reason": None}]})
                sent += k
            emit({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                  "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            said = {"metrics": {"speculative_decoding": {"num_spec_tokens": 3}}} \
                if speculative else {}  # D, as vLLM's per-request metrics say it
            emit({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                  "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                           "total_tokens": 7 + n}, **said})
            self.wfile.write(b"data: [DONE]\n\n")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1", seen


def measured(seen: list[dict]) -> list[dict]:
    """The requests an eval measured: without the one-token probe that asks the speculating
    server for its D before each concurrency's first batch."""
    return [p for p in seen if p["max_tokens"] != 1]


@pytest.fixture
def servers():
    spec, spec_url, seen = serve(True)
    base, base_url, _ = serve(False)
    yield spec_url, base_url, seen
    spec.shutdown()
    base.shutdown()


def test_endpoint_eval_measures_both_arms_and_scrapes_counters(tmp_path, servers) -> None:
    spec_url, base_url, seen = servers
    requests = [WorkloadRequest(id=f"r{i}", category="c", prompt=f"hello {i}") for i in range(4)]
    params = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=10, seed=3)
    path = run_endpoint_eval(tmp_path, requests, spec_url, "m", params, [1, 2],
                             baseline_url=base_url)
    records = read_records(path)
    assert len(records) == 2 * 2 * 4
    spec = [r for r in records if r["arm"] == "spec"]
    assert all(r["output_tokens"] == 10 and len(r["token_times_s"]) == 4 for r in spec)
    assert all(r["ttft_s"] > 0 and r["context_tokens"] == 7 for r in records)
    assert len(seen) - len(measured(seen)) == 2  # a probe per concurrency
    assert {p["seed"] for p in measured(seen)} == {r["seed"] for r in spec}  # seeds arrive
    assert all(p["temperature"] == 0.5 and p["top_p"] == 0.9 for p in measured(seen))
    summary = summarize(records)["endpoint/D3/c2"]
    assert summary["spec"]["tpot_ms_p50"] > 0 and "speedup_tpot_p50" in summary
    counters = json.loads((tmp_path / "server_counters.json").read_text())
    spec_counters = counters["endpoint/D3/c1/spec"]
    assert spec_counters["acceptance_rate"] == pytest.approx(2 / 3)
    assert spec_counters["al_from_counters"] == pytest.approx(1 + 2 / 1)
    assert summary["spec"]["al_pooled"] != summary["spec"]["al_pooled"]  # NaN: not visible
    assert "endpoint/D3/c1/baseline" not in counters  # the plain server has no /metrics
    with pytest.raises(FileExistsError):
        run_endpoint_eval(tmp_path, requests, spec_url, "m", params, [1])
    again = run_endpoint_eval(tmp_path, requests, spec_url, "m", params, [1, 2],
                              baseline_url=base_url, resume=True)
    assert len(read_records(again)) == 16  # resume: nothing measured twice


def test_counter_parsing_and_deltas() -> None:
    assert scrape("http://127.0.0.1:9/v1", timeout=0.5) is None
    assert counter_delta(None, {"drafts": 1}) == {}
    d = counter_rates(counter_delta(
        {"drafts": 2, "proposed_tokens": 8, "accepted_draft_tokens": 4},
        {"drafts": 6, "proposed_tokens": 24, "accepted_draft_tokens": 10}))
    assert d["acceptance_rate"] == pytest.approx(6 / 16)
    assert d["al_from_counters"] == pytest.approx(2.5)


def test_trtspec_eval_against_endpoints_from_the_cli(tmp_path, servers, capsys) -> None:
    from pathlib import Path

    from trtspec.cli import main

    spec_url, base_url, _ = servers
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "cpu-smollm2.yaml"
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": f"q{i}", "category": "c", "prompt": "hi"})
                                + "\n" for i in range(3)))
    main(["eval", str(recipe), "--endpoint", spec_url, "--model", "m", "--baseline-endpoint",
          base_url, "-w", str(workload), "--reports", str(tmp_path), "--eval-id", "ep",
          "--set", "sampling.max_tokens=9", "--set", "eval.concurrency=[3]",
          "--set", "eval.per_category=null", "--no-mlflow"])
    assert "endpoint/D3/c3" in capsys.readouterr().out
    assert len(read_records(tmp_path / "ep")) == 6
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(recipe), "--endpoint", spec_url, "--reports", str(tmp_path)])
    assert exit_info.value.code == 2 and "--endpoint needs --model" in capsys.readouterr().err


def test_arms_alternate_turn_by_turn_and_top_k_reaches_the_server(tmp_path) -> None:
    """One log of both servers' requests: at c = 2 a turn is 8 requests from 2 closed-loop
    clients; turns go spec, baseline, then baseline, spec."""
    seen: list[dict] = []
    spec, spec_url, spec_seen = serve(True)
    base, base_url, base_seen = serve(False)
    try:
        requests = [WorkloadRequest(id=f"r{i}", category="c", prompt=f"p{i}")
                    for i in range(12)]
        params = SamplingParams(temperature=0.7, top_k=20, max_tokens=3, seed=1)
        run_endpoint_eval(tmp_path, requests, spec_url, "m", params, [2], baseline_url=base_url)
    finally:
        spec.shutdown()
        base.shutdown()
    assert len(spec_seen) - len(measured(spec_seen)) == 1  # the probe, before the first batch
    seen = sorted(measured(spec_seen) + base_seen, key=lambda p: p["at"])
    order = ["spec" if p["speculative"] else "baseline" for p in seen]
    assert order == ["spec"] * 8 + ["baseline"] * 8 + ["baseline"] * 4 + ["spec"] * 4
    assert all(p["top_k"] == 20 for p in seen)


def test_a_failed_request_is_recorded_and_the_arm_goes_on(tmp_path) -> None:
    server, url, _ = serve(True, fail={"p1"}, break_off={"p3"}, cut={"p4"})
    try:
        requests = [WorkloadRequest(id=f"r{i}", category="c", prompt=f"p{i}") for i in range(5)]
        params = SamplingParams(temperature=0.0, max_tokens=3, seed=1)
        records = read_records(run_endpoint_eval(tmp_path, requests, url, "m", params, [1]))
        assert len(records) == 5
        gone = next(r for r in records if r["request_id"] == "r4")  # the connection closed
        assert gone["finish_reason"] == "error" and gone["error"], gone
        bad = next(r for r in records if r["request_id"] == "r1")
        assert bad["finish_reason"] == "error" and "InternalServerError" in bad["error"]
        cut = next(r for r in records if r["request_id"] == "r3")  # an error event mid-stream
        assert cut["finish_reason"] == "error" and "the model failed" in cut["error"]
        entry = summarize(records, ("spec",))["endpoint/D3/c1"]["spec"]
        assert entry["failed_requests"] == 3 and entry["requests"] == 2
        # resume measures the failed request again
        again = read_records(run_endpoint_eval(tmp_path, requests, url, "m", params, [1],
                                               resume=True))
        assert [r["request_id"] for r in again].count("r1") == 2
    finally:
        server.shutdown()
    down = f"http://127.0.0.1:{_free_port()}/v1"
    with pytest.raises(RuntimeError, match=r"\(spec arm\) failed every request of its first "
                                           r"batch: APIConnectionError"):
        run_endpoint_eval(tmp_path / "down", requests, down, "m", params, [1])
    kept = read_records(tmp_path / "down")
    assert len(kept) == 1  # kept, named for a server that said nothing about its D
    assert kept[0]["condition"] == "endpoint/Dunknown/c1" and kept[0]["draft_len"] == "unknown"


def _free_port() -> int:
    from conftest import free_port

    return free_port()


def test_benchmark_knobs_reach_the_server_and_resume_reuses_them(tmp_path, capsys) -> None:
    """--num-prompts, --max-tokens (over the workload's own), --ignore-eos and --concurrency,
    as `vllm bench serve` users know them; `--resume` alone measures the same again."""
    from pathlib import Path

    from trtspec.cli import main

    server, url, seen = serve(True)
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "cpu-smollm2.yaml"
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": f"q{i}", "category": "ab"[i % 2],
                                            "prompt": f"p{i}", "max_tokens": 50}) + "\n"
                                for i in range(6)))
    try:
        main(["eval", str(recipe), "--endpoint", url, "--model", "m", "-w", str(workload),
              "--num-prompts", "4", "--max-tokens", "5", "--ignore-eos", "--concurrency", "2,4",
              "--reports", str(tmp_path), "--eval-id", "k", "--no-mlflow"])
        printed = capsys.readouterr().out
        assert "--num-prompts 4: a 2, b 2" in printed
        assert {"endpoint/D3/c2", "endpoint/D3/c4"} <= set(printed.split())
        assert len(seen) == 2 * 4 + 2 and all(p["max_tokens"] == 5 and p["ignore_eos"]
                                              for p in measured(seen))
        records = read_records(tmp_path / "k")
        (tmp_path / "k" / "records.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records[:-3]))
        main(["eval", str(recipe), "--resume", str(tmp_path / "k"), "--no-mlflow"])
    finally:
        server.shutdown()
    # the c4 batch was cut short: measured again whole (4 requests), 3 of them recorded
    # no probe on resume: the records name the conditions
    assert len(seen) == 2 * 4 + 2 + 4 and all(p["max_tokens"] == 5 for p in measured(seen))
    assert len(read_records(tmp_path / "k")) == 8
    counters = json.loads((tmp_path / "k" / "server_counters.json").read_text())
    assert counters["endpoint/D3/c4/spec"]["raw"]["drafts"] == 4 * 2  # replaced, not added


def test_an_endpoint_that_refuses_connections_is_one_line_and_leaves_no_folder(
        tmp_path, capsys) -> None:
    from pathlib import Path

    from trtspec.cli import main

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "cpu-smollm2.yaml"
    down = f"http://127.0.0.1:{_free_port()}/v1"
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(recipe), "--endpoint", down, "--model", "m", "--reports",
              str(tmp_path), "--eval-id", "x"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"{down}: cannot connect" in err and "Connection refused" in err
    assert not (tmp_path / "x").exists()


def test_a_condition_is_named_after_the_d_the_server_says() -> None:
    from trtspec.analysis.records import condition_parts
    from trtspec.eval.endpoint import announced_draft_len

    assert announced_draft_len({"metrics": {"speculative_decoding": None}}) == 0  # plain
    assert announced_draft_len({"metrics": {"speculative_decoding": {"num_spec_tokens": 4}}}) \
        == 4
    assert announced_draft_len({"spec": {"proposed_tokens": 3}}) == "unknown"
    assert announced_draft_len({}) == "unknown"
    # every consumer of condition names reads an unknown D as it reads adaptive: not an int
    assert condition_parts("endpoint/Dunknown/c2") == ("endpoint", "unknown", 2)


def test_the_baselines_top_list_decides_a_tie_never_the_speculating_servers() -> None:
    """At the first difference (baseline "a", spec "b"): the baseline's list holding both gives
    the margin; a baseline list without "b" is a divergence at least as wide as its last
    entry, whatever the speculating server's own list shows; the spec's list counts only where
    the baseline listed nothing there."""
    from trtspec.eval.endpoint import divergence

    def record(texts, tops, digest):
        return {"output_token_texts": texts, "top_logprobs": tops, "output_digest": digest}

    spec = record(["x", "b"], [[], [["b", -0.70], ["a", -0.71]]], "s")
    both = record(["x", "a"], [[], [["a", -0.69], ["b", -0.70]]], "a")
    assert divergence(both, spec)["margin"] == pytest.approx(0.01)
    assert divergence(both, spec)["margin_arm"] == "baseline"
    without_b = record(["x", "a"], [[], [["a", -0.1], ["c", -2.5]]], "a")
    entry = divergence(without_b, spec)
    assert entry["margin"] is None and entry["margin_at_least"] == pytest.approx(2.4)
    unlisted = record(["x", "a"], [[]], "a")
    entry = divergence(unlisted, spec)
    assert entry["margin"] == pytest.approx(0.01) and entry["margin_arm"] == "spec"
