"""The soak run of bench_serve.py (``--soak``): does `trtspec serve` hold up over a long run, over
HTTP as clients see it? `trtspec serve` runs in a subprocess (the recipe's build, or ``--backend
toy``). A warm-up (a batch drawn as the run is, then every client at once with the longest
prompts and output the run can draw, so the KV cache is at the size the run's largest moment
needs when memory is first read), then ``--soak-requests`` streaming chat requests from
``--soak-clients`` closed-loop clients (the real ``openai`` client) with mixed prompt and output
lengths; a fifth of them are dropped by the client at a random chunk (0: right after admission).
Checks: the server's resident memory grows ≤ 5 % from after the warm-up to the end (read after
the largest batch is run again, so both readings see the cache in the same state: it shrinks
when long requests leave); no request is lost (neither completed nor dropped by us); the server
counted every request as ended; /health answers 200 with no request running or waiting at the
end. TPOT p50 / p99 of the first and last quarter of requests show drift. Everything is seeded
(``--seed``: the plan; each request's seed is its index). Resident memory is read at each tenth
of the run too: a leak grows with requests served, a cache still reaching its size levels off.
The report's "## Soak" section, kept last, is written or replaced; the exit status is 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtspec.analysis.records import distribution

SOAK = "## Soak"  # the report's last section, replaced by each soak run
MAX_TOKENS = (1, 2, 4, 8, 16, 32)
PROMPT_CHARS = (64, 256, 1024, 4096)  # a built-in prompt this long, cut (recipe backend)
PROMPT_IDS = (1, 4, 16, 64)  # token ids in a toy prompt (vocabulary 32)
DROPPED = 0.2
GROWTH = 0.05  # resident memory, after the warm-up → the end


@dataclass(frozen=True)
class Job:
    index: int
    seed: int
    content: str
    max_tokens: int
    temperature: float
    drop_after: int | None  # the client closes the stream after this many chunks (0: at once)


@dataclass(frozen=True)
class Outcome:
    job: Job
    kind: str  # completed, dropped or lost
    ttft: float | None = None
    tpot: float | None = None
    why: str = ""  # a lost request: what went wrong


def largest_jobs(clients: int, toy: bool, first_seed: int) -> list[Job]:
    """One request a client with the longest prompt and output soak_jobs can draw, none
    dropped: run at once, they take the KV cache to the size the run's largest moment needs.
    The recipe's prompts cycle over every built-in text as long as the longest cut: cut to
    the same characters, they differ in tokens, and the server's tokenizer is not here."""
    from trtspec.eval.workloads import builtin

    longest = max(PROMPT_CHARS)
    contents = [" ".join(str(i % 32) for i in range(max(PROMPT_IDS)))] if toy else \
        [t[:longest] for t in (_text(r.chat()) for r in builtin()) if len(t) >= longest]
    return [Job(i, first_seed + i, contents[i % len(contents)], max(MAX_TOKENS), 0.0, None)
            for i in range(clients)]


def soak_jobs(n: int, toy: bool, seed: int, first_seed: int = 0) -> list[Job]:
    """n seeded requests: output lengths from MAX_TOKENS, prompt lengths from PROMPT_CHARS
    (a built-in prompt at least that long, cut to it) or PROMPT_IDS, temperature 0 or 0.8, a
    DROPPED share dropped after a random number of chunks below max_tokens."""
    from trtspec.eval.workloads import builtin

    rng = random.Random(seed)
    texts = [] if toy else [_text(r.chat()) for r in builtin()]
    jobs = []
    for i in range(n):
        max_tokens = rng.choice(MAX_TOKENS)
        if toy:
            content = " ".join(str(rng.randrange(32)) for _ in range(rng.choice(PROMPT_IDS)))
        else:
            chars = rng.choice(PROMPT_CHARS)
            content = rng.choice([t for t in texts if len(t) >= chars])[:chars]
        drop = rng.randrange(max_tokens) if rng.random() < DROPPED else None
        jobs.append(Job(i, first_seed + i, content, max_tokens, rng.choice((0.0, 0.8)), drop))
    return jobs


def _text(chat: str | list[dict[str, str]]) -> str:
    """A built-in request as one user message (a conversation's turns joined)."""
    return chat if isinstance(chat, str) else "\n\n".join(m["content"] for m in chat)


async def one(client: Any, model: str, job: Job) -> Outcome:
    """One streaming chat request; ignore_eos, so a completed one returns max_tokens tokens."""
    sent, times, chunks, finish, tokens = time.perf_counter(), [], 0, None, None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": job.content}],
            max_tokens=job.max_tokens, temperature=job.temperature, seed=job.seed, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        try:
            if job.drop_after == 0:  # admitted (the server answered with its headers)
                return Outcome(job, "dropped")
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                choice, chunks = chunk.choices[0], chunks + 1
                if choice.delta is not None and choice.delta.content:
                    times.append(time.perf_counter())
                finish = choice.finish_reason or finish
                if finish is None and job.drop_after is not None and chunks >= job.drop_after:
                    return Outcome(job, "dropped")
        finally:
            await stream.close()
    except Exception as e:  # whatever failed, this request is lost: say why, go on
        return Outcome(job, "lost", why=f"{type(e).__name__}: {e}"[:200])
    if finish is None or tokens != job.max_tokens:
        return Outcome(job, "lost", why=f"finish_reason {finish}, {tokens} of {job.max_tokens} "
                                        "tokens")
    return Outcome(job, "completed", times[0] - sent if times else None,
                   (times[-1] - times[0]) / (tokens - 1) if tokens > 1 and len(times) > 1
                   else None)


@dataclass
class Memory:
    """A process's resident memory through a run: its peak, and its reading as each tenth of
    the run's requests had ended (bytes)."""
    pid: int
    peak: int
    tenths: list[int]


async def drive(base: str, model: str, jobs: list[Job], clients: int,
                memory: Memory | None = None) -> list[Outcome]:
    """``clients`` closed-loop clients take the jobs in order; with ``memory``, the process's
    resident memory is read every 0.5 s into it."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base}/v1", max_retries=0, timeout=900,
                         api_key=os.environ.get("TRTSPEC_API_KEY", "EMPTY"))
    pending, outcomes = iter(jobs), []

    async def worker() -> None:
        for job in pending:  # shared: each job is taken once
            outcomes.append(await one(client, model, job))
            if memory is not None and len(memory.tenths) < 9 and \
                    len(outcomes) >= (len(memory.tenths) + 1) * len(jobs) / 10:
                memory.tenths.append(resident(memory.pid))  # (one coroutine at a time:
                # each tenth once, read as it is crossed)

    async def watch() -> None:
        while memory is not None:
            memory.peak = max(memory.peak, resident(memory.pid))
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(*(worker() for _ in range(clients)))
    finally:
        watcher.cancel()
        await client.close()
    return sorted(outcomes, key=lambda o: o.job.index)


def get(url: str) -> tuple[int, str]:
    """(HTTP status, body); status 0 when nothing answers. Sends $TRTSPEC_API_KEY, which the
    server was started with too."""
    key = os.environ.get("TRTSPEC_API_KEY")
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key
                                      else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def gauges(base: str) -> dict[str, float]:
    """/metrics as {series (with its labels): value}."""
    out = {}
    for line in get(f"{base}/metrics")[1].splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def ended(metrics: dict[str, float]) -> float:
    """Requests the server counted as ended, any finish reason (a drop is an abort)."""
    return sum(v for k, v in metrics.items() if k.startswith("trtspec:request_success_total"))


def drain(base: str, timeout: float = 300.0) -> tuple[float, float, float]:
    """(running, waiting, seconds waited): once both gauges read 0, or at the timeout (a
    dropped request leaves its slot within a round)."""
    start = time.monotonic()
    while True:
        m = gauges(base)
        running = m.get("trtspec:num_requests_running", -1.0)
        waiting = m.get("trtspec:num_requests_waiting", -1.0)
        if (running, waiting) == (0, 0) or not m or time.monotonic() - start > timeout:
            return running, waiting, time.monotonic() - start
        time.sleep(0.1)


def start_server(target: list[str], log: Any, timeout: float = 1800.0
                 ) -> tuple[subprocess.Popen, str]:
    """`trtspec serve TARGET` on a free port, in its own session, once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "trtspec", "serve", *target, "--port",
                             str(port)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if get(f"{base}/health")[0] == 200:
            return proc, base
        time.sleep(0.2)
    stop_server(proc)
    raise SystemExit(f"trtspec serve {' '.join(target)} did not come up; its log:\n"
                     f"{Path(log.name).read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def resident(pid: int) -> int:
    """The process's resident memory in bytes; 0 once it is gone (a server that died fails
    the growth check instead of stopping the report)."""
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.NoSuchProcess:
        return 0


def soak(args: argparse.Namespace) -> int:
    n = args.soak_requests or (40 if args.quick else 2000)
    clients, backend = args.soak_clients, args.backend or ("toy" if args.quick else "recipe")
    warm = args.soak_warmup if args.soak_warmup is not None else 2 * clients
    toy = backend == "toy"
    target = (["--backend", "toy"] if toy else [args.recipe]) + (
        ["--method", args.method] if args.method else [])
    jobs = soak_jobs(n, toy, args.seed)
    largest = largest_jobs(clients, toy, first_seed=10**6 - clients)
    warmup = soak_jobs(warm, toy, args.seed + 1, first_seed=10**6)
    with tempfile.NamedTemporaryFile("w+", prefix="soak-serve-", suffix=".log") as log:
        proc, base = start_server(target, log)
        try:
            model = json.loads(get(f"{base}/v1/models")[1])["data"][0]["id"]
            asyncio.run(drive(base, model, warmup, clients))
            asyncio.run(drive(base, model, largest, clients))  # last: the cache at its size
            drain(base)  # (a smaller batch after it could shrink it)
            rss_warm = resident(proc.pid)
            memory, before, start = Memory(proc.pid, rss_warm, []), ended(gauges(base)), \
                time.perf_counter()
            outcomes = asyncio.run(drive(base, model, jobs, clients, memory))
            wall = time.perf_counter() - start
            running, waiting, drained = drain(base)
            health, counted = get(f"{base}/health")[0], ended(gauges(base)) - before
            memory.tenths.append(resident(proc.pid))  # the run's end, as it left the cache
            asyncio.run(drive(base, model, largest, clients))  # (greedy: seeds moot)
            drain(base)  # the largest batch again (counted above: not the run's requests),
            rss_end = resident(proc.pid)  # memory read in the warm-up's cache state
        finally:
            stop_server(proc)
        said = [line.strip() for line in Path(log.name).read_text().splitlines()
                if line.startswith(("trtspec serve: http", "policy:", "note:"))]  # start-up
    kinds = {k: sum(o.kind == k for o in outcomes) for k in ("completed", "dropped", "lost")}
    growth = rss_end / rss_warm - 1 if rss_end else float("inf")
    checks = [
        ("server RSS, after warm-up → end",
         f"{rss_warm / 2**20:.1f} → {rss_end / 2**20:.1f} MiB ({100 * growth:+.1f} %; peak "
         f"{max(memory.peak, rss_end) / 2**20:.1f})", f"≤ +{100 * GROWTH:.0f} %", growth <= GROWTH),
        ("requests lost", str(kinds["lost"]), "0", kinds["lost"] == 0),
        ("requests the server ended (`trtspec:request_success_total`)",
         f"{counted:.0f} of {n}", "all", counted == n),
        ("/health at the end", str(health), "200", health == 200),
        ("running / waiting at the end", f"{running:.0f} / {waiting:.0f} (after "
         f"{drained:.1f} s)", "0 / 0", (running, waiting) == (0, 0))]
    ok = all(c[3] for c in checks)
    what = "`trtspec serve --backend toy`" if toy else f"`trtspec serve {args.recipe}`"
    quarter = max(1, n // 4)
    lines = [
        SOAK, "",
        f"{what}, {n} streaming chat requests from {clients} closed-loop "
        f"clients (the `openai` client) after a warm-up of {warm} requests drawn as the run's "
        f"are, then {clients} at once with the longest prompts and max_tokens "
        f"{max(MAX_TOKENS)} (run again after the run, before the last memory reading); "
        "max_tokens drawn from "
        f"{', '.join(map(str, MAX_TOKENS))} with ignore_eos (a completed request returns all "
        "of them), prompts "
        + (f"of {', '.join(map(str, PROMPT_IDS))} token ids" if toy else "of built-in "
           f"workload prompts cut to {', '.join(map(str, PROMPT_CHARS))} characters")
        + f", temperature 0 or 0.8; {100 * DROPPED:.0f} % planned drops: the client closes "
        "the stream after a random number of chunks below max_tokens (0: right after "
        f"admission; one that ends first counts as completed). Seed {args.seed}; the "
        f"{n} requests took {wall:.1f} s on {platform.processor() or platform.machine()}.",
        "", "The server said at start-up: " + " · ".join(f"`{line}`" for line in said), "",
        "| requests | completed | dropped | lost | TTFT p50 ms | TPOT p50 / p99 ms |",
        "|---|---:|---:|---:|---:|---|",
        soak_row(f"first quarter (1–{quarter})", outcomes[:quarter]),
        soak_row(f"last quarter ({n - quarter + 1}–{n})", outcomes[-quarter:]),
        soak_row(f"all {n}", outcomes), "",
        "Server RSS (MiB) after the warm-up, as each tenth of the run's requests had ended "
        "(the last: once the run drained), and at the end (after the largest batch again): "
        + " → ".join(f"{b / 2**20:.0f}" for b in [rss_warm, *memory.tenths, rss_end]) + ".",
        "",
        "| check | measured | limit | |", "|---|---|---|---|",
        *(f"| {name} | {value} | {limit} | {'ok' if good else '**FAIL**'} |"
          for name, value, limit, good in checks), ""]
    lost = [o for o in outcomes if o.kind == "lost"]
    if lost:
        lines += ["Lost requests (up to 5): " + "; ".join(
            f"#{o.job.index + 1} ({o.job.max_tokens} tokens): {o.why}" for o in lost[:5]), ""]
    lines += [f"{'PASS' if ok else 'FAIL'}. Command: `.venv/bin/python "
              f"{shlex.join(['benchmarks/bench_serve.py', *sys.argv[1:]])}`", ""]
    write_report(args.out, "\n".join(lines), soak_section=True)
    print("\n".join(lines))
    print(f"wrote the {SOAK[3:]} section of {args.out}")
    return 0 if ok else 1


def soak_row(label: str, outcomes: list[Outcome]) -> str:
    """A table row: outcomes, and TTFT and TPOT percentiles of the completed requests."""
    counts = [sum(o.kind == k for o in outcomes) for k in ("completed", "dropped", "lost")]
    t = (distribution([o.ttft for o in outcomes if o.ttft is not None], "ttft")
         | distribution([o.tpot for o in outcomes if o.tpot is not None], "tpot"))
    return (f"| {label} | {' | '.join(map(str, counts))} | "
            + (f"{t['ttft_p50']:.1f}" if "ttft_p50" in t else "–") + " | "
            + (f"{t['tpot_p50']:.2f} / {t['tpot_p99']:.2f}" if "tpot_p50" in t else "–") + " |")


def write_report(path: Path, text: str, soak_section: bool) -> None:
    """Replace the scheduler tables (everything before the Soak section) or the Soak section
    (kept last), leaving the other as it was."""
    old = path.read_text() if path.exists() else ""
    head, found, tail = old.partition(f"\n{SOAK}\n")
    if not found and old.startswith(f"{SOAK}\n"):
        head, tail, found = "", old.removeprefix(f"{SOAK}\n"), "yes"
    kept = f"{SOAK}\n{tail}" if found else ""
    if soak_section:
        new = (f"{head.rstrip()}\n\n" if head.strip() else "") + text
    else:
        new = text.rstrip() + (f"\n\n{kept}" if kept else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new.rstrip() + "\n")
