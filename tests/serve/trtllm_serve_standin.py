"""A stand-in for TensorRT-LLM's ``trtllm-serve``, for tests only. It is NOT TensorRT-LLM, and
nothing it measures is TensorRT-LLM's: it answers like trtllm-serve from a toy model.

The ``trtllm_serve`` fixture (tests/conftest.py) puts it on PATH as ``trtllm-serve``. It takes
TensorRT-LLM 1.2.1's flag names only (argparse exits 2 on any other, so a misspelt flag fails a
test), appends what it was started with (argv and the options file's content) and every
signal it gets to the JSON-lines file ``$TRTLLM_STANDIN_LOG``, and serves GET /health,
/v1/models, /metrics and POST /v1/completions, /v1/chat/completions (streamed too, with
``stream_options.include_usage``, and ``logprobs`` / ``top_logprobs``).

The model: an order-2 Markov chain over 32 tokens (the toy model's form, trtspec/runtime/toy.py;
numpy here, so a start takes a fraction of a second), prompt bytes mod 32 as its tokens, token
i written " w<i>". Greedy at temperature 0, else sampled with the request's seed. A server whose
options have a ``speculative_config`` emits max_draft_len + 1 tokens per step (a step sleeps
``$TRTLLM_STANDIN_STEP_S``), so it is faster per token, as a speculating server would be.

Knobs (environment): ``TRTLLM_STANDIN_EXIT=N`` exits with N before serving, after two log
lines; ``TRTLLM_STANDIN_IGNORE_TERM=1`` records SIGTERM but keeps running (a server that needs
SIGKILL); ``TRTLLM_STANDIN_TIE_AT=K`` makes output position K a near-tie (the runner-up logit
``$TRTLLM_STANDIN_TIE_MARGIN`` below the best, default 0.01) where a speculating server emits
the runner-up, as bf16 kernels of different shapes may.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import yaml

VOCAB, ORDER = 32, 2


def parse(argv: list[str]) -> argparse.Namespace:
    """TensorRT-LLM 1.2.1's trtllm-serve flags (tensorrt_llm/commands/serve.py), the ones
    trtspec uses and a few more; anything else is an error (exit 2)."""
    p = argparse.ArgumentParser(prog="trtllm-serve", allow_abbrev=False)
    p.add_argument("model")
    p.add_argument("--backend", choices=["pytorch", "tensorrt", "_autodeploy"],
                   default="pytorch")
    p.add_argument("--tokenizer")
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log_level", default="info")
    for flag in ("--tp_size", "--pp_size", "--ep_size", "--gpus_per_node", "--max_beam_width",
                 "--max_batch_size", "--max_num_tokens", "--max_seq_len"):
        p.add_argument(flag, type=int)
    p.add_argument("--kv_cache_free_gpu_memory_fraction", type=float)
    p.add_argument("--num_postprocess_workers", type=int)
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--config", "--extra_llm_api_options", dest="config")
    return p.parse_args(argv)


def record(event: dict[str, Any]) -> None:
    path = os.environ.get("TRTLLM_STANDIN_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


class Model:
    """Order-2 Markov chain: logits = table[last two tokens]."""

    def __init__(self, tie_at: int | None, tie_margin: float) -> None:
        self.table = np.random.default_rng(0).standard_normal((VOCAB**ORDER, VOCAB)) * 2.0
        self.tie_at, self.tie_margin = tie_at, tie_margin

    def logits(self, tokens: list[int], position: int) -> tuple[np.ndarray, int | None]:
        """(logits, the runner-up token at the tie position, else None)."""
        a, b = ([0, 0] + tokens)[-2:]
        row = self.table[a * VOCAB + b].copy()
        if position != self.tie_at:
            return row, None
        best, second = np.argsort(-row)[:2]
        row[second] = row[best] - self.tie_margin
        return row, int(second)

    @staticmethod
    def encode(text: str) -> list[int]:
        return [c % VOCAB for c in text.encode()] or [0]


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


class Generation:
    """One request's tokens, as (text, logprobs entry) per token, in steps of ``per_step``."""

    def __init__(self, model: Model, prompt: list[int], body: dict[str, Any],
                 speculating: bool, per_step: int) -> None:
        self.model, self.tokens, self.prompt = model, list(prompt), len(prompt)
        self.max_tokens = int(body.get("max_tokens") or 16)
        self.temperature = float(body.get("temperature") or 0.0)
        self.rng = np.random.default_rng(body.get("seed") or 0)
        self.speculating, self.per_step = speculating, per_step
        k = body.get("top_logprobs")
        if body.get("logprobs") is True:  # chat: logprobs true + top_logprobs k
            self.top = int(k or 0)
        elif isinstance(body.get("logprobs"), int) and not isinstance(body["logprobs"], bool):
            self.top = int(body["logprobs"])  # completions: logprobs = k
        else:
            self.top = None

    def next(self) -> tuple[str, dict[str, Any]]:
        position = len(self.tokens) - self.prompt
        logits, runner_up = self.model.logits(self.tokens, position)
        lp = log_softmax(logits)
        if self.temperature > 0:
            p = np.exp(log_softmax(logits / self.temperature))
            token = int(self.rng.choice(VOCAB, p=p / p.sum()))
        elif runner_up is not None and self.speculating:
            token = runner_up
        else:
            token = int(np.argmax(logits))
        self.tokens.append(token)
        text = f" w{token}"
        entry = {"token": text, "logprob": float(lp[token]), "bytes": list(text.encode()),
                 "top_logprobs": [{"token": f" w{int(i)}", "logprob": float(lp[i]),
                                   "bytes": list(f" w{int(i)}".encode())}
                                  for i in np.argsort(-lp)[: self.top or 0]]}
        return text, entry

    def steps(self, step_s: float):
        """Lists of (text, entry), one list per forward."""
        made = 0
        while made < self.max_tokens:
            time.sleep(step_s)
            n = min(self.per_step, self.max_tokens - made)
            yield [self.next() for _ in range(n)]
            made += n


def main() -> None:
    args = parse(sys.argv[1:])
    options = {}
    if args.config:
        with open(args.config) as f:
            options = yaml.safe_load(f) or {}
    record({"event": "start", "argv": sys.argv[1:], "options": options, "pid": os.getpid()})
    print("trtllm-serve stand-in (tests only; not TensorRT-LLM) starting", flush=True)
    code = os.environ.get("TRTLLM_STANDIN_EXIT")
    if code:
        print("loading the model … failed on purpose", flush=True)
        print("RuntimeError: the stand-in was told to exit", flush=True)
        sys.exit(int(code))
    spec = options.get("speculative_config") or None
    per_step = int(spec.get("max_draft_len", 1)) + 1 if spec else 1
    step_s = float(os.environ.get("TRTLLM_STANDIN_STEP_S", "0.002"))
    tie = os.environ.get("TRTLLM_STANDIN_TIE_AT")
    model = Model(int(tie) if tie else None,
                  float(os.environ.get("TRTLLM_STANDIN_TIE_MARGIN", "0.01")))
    served = args.model

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *_: Any) -> None:
            pass

        def reply(self, status: int, body: Any, kind: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self.reply(200, b"", "text/plain")
                record({"event": "health", "pid": os.getpid()})  # answered: a client saw 200
            elif self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{
                    "id": served, "object": "model", "created": 0,
                    "owned_by": "trtllm-serve stand-in (tests; not TensorRT-LLM)"}]})
            elif self.path == "/metrics":
                self.reply(200, [])
            else:
                self.reply(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            chat = self.path == "/v1/chat/completions"
            if not chat and self.path != "/v1/completions":
                self.reply(404, {"error": {"message": f"no route {self.path}"}})
                return
            prompt = " ".join(m["content"] for m in body["messages"]) if chat \
                else str(body["prompt"])
            tokens = Model.encode(prompt)
            gen = Generation(model, tokens, body, spec is not None, per_step)
            kind = "chat.completion" if chat else "text_completion"
            usage = {"prompt_tokens": len(tokens), "completion_tokens": gen.max_tokens,
                     "total_tokens": len(tokens) + gen.max_tokens}
            if not body.get("stream"):
                pieces = [p for step in gen.steps(step_s) for p in step]
                text = "".join(t for t, _ in pieces)
                logprobs = {"content": [e for _, e in pieces]} if gen.top is not None else None
                choice = {"index": 0, "finish_reason": "length", "logprobs": logprobs,
                          **({"message": {"role": "assistant", "content": text}} if chat
                             else {"text": text})}
                self.reply(200, {"id": "standin", "object": kind, "created": 0,
                                 "model": served, "choices": [choice], "usage": usage})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()

            def emit(obj: Any) -> None:
                data = obj if isinstance(obj, str) else json.dumps(obj)
                self.wfile.write(f"data: {data}\n\n".encode())
                self.wfile.flush()

            made = 0
            for step in gen.steps(step_s):
                made += len(step)
                text = "".join(t for t, _ in step)
                last = made >= gen.max_tokens
                logprobs = {"content": [e for _, e in step]} if gen.top is not None else None
                choice = {"index": 0, "logprobs": logprobs,
                          "finish_reason": "length" if last else None,
                          **({"delta": {"content": text}} if chat else {"text": text})}
                emit({"id": "standin", "object": f"{kind}.chunk" if chat else kind,
                      "created": 0, "model": served, "choices": [choice]})
            if (body.get("stream_options") or {}).get("include_usage"):
                emit({"id": "standin", "object": f"{kind}.chunk" if chat else kind,
                      "created": 0, "model": served, "choices": [], "usage": usage})
            emit("[DONE]")

    httpd = ThreadingHTTPServer((args.host, args.port), Handler)
    httpd.daemon_threads = True
    stop = threading.Event()
    ignore_term = os.environ.get("TRTLLM_STANDIN_IGNORE_TERM") == "1"

    def on_signal(sig: int, _frame: Any) -> None:
        record({"event": "signal", "signal": signal.Signals(sig).name, "pid": os.getpid()})
        if not (ignore_term and sig == signal.SIGTERM):
            stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    print(f"serving on http://{args.host}:{args.port}", flush=True)
    while not stop.wait(0.05):
        pass
    httpd.shutdown()
    record({"event": "exit", "pid": os.getpid()})
    print("stand-in stopped", flush=True)


if __name__ == "__main__":
    main()
