"""Time trtspec.spec.sample.verify against the machine's memory bandwidth, in one run.

For B ∈ {1, 8, 64}, K = 4, V ∈ {32000, 128256}: median time of one verify() call in three modes
(sampled with draft probs q, point-mass drafts, greedy), the bytes of p [B, K+1, V] and q [B, K, V]
it is handed, the resulting GB/s, and that rate as a fraction of a large tensor copy measured in
the same process (STREAM-style: bytes read + written). Writes reports/bench-verify.md.

    python benchmarks/bench_verify.py                  # full run (~1 min on 2 cores)
    python benchmarks/bench_verify.py --quick          # tiny sizes, a smoke test
    python benchmarks/bench_verify.py --device cuda    # every tensor on the GPU (the copy too)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from trtspec.spec.sample.verify import verify

K = 4


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2,
                   device: str = "cpu") -> float:
    """Median wall time of ``fn``; on a GPU each call is waited for, since kernels launch
    asynchronously and the call would otherwise time the launch alone."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_gbps(nbytes: int, repeats: int, device: str = "cpu") -> float:
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats, device=device)
    return 2 * nbytes / seconds / 1e9  # read + write


def make_inputs(b: int, v: int, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, K + 1, v, generator=g) * 3
    p = torch.softmax(logits, -1)  # [B, K+1, V]
    q = torch.softmax(logits[:, :K] + torch.randn(b, K, v, generator=g), -1)  # [B, K, V]
    ids = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(b, K)  # [B, K]
    return p.to(device), q.to(device), ids.to(device)


def run(sizes_b: list[int], sizes_v: list[int], repeats: int, copy_bytes: int,
        device: str = "cpu") -> list[dict]:
    before = copy_gbps(copy_bytes, repeats, device)
    rows = []
    for v in sizes_v:
        for b in sizes_b:
            p, q, ids = make_inputs(b, v, device=device)
            num_draft = torch.full((b,), K, device=device)
            gens = [torch.Generator().manual_seed(i) for i in range(b)]
            modes = {
                "sampled (q)": (partial(verify, p, ids, q, num_draft, gens), p.nbytes + q.nbytes),
                "point-mass": (partial(verify, p, ids, None, num_draft, gens), p.nbytes),
                "greedy": (partial(verify, p, ids, None, num_draft, greedy=True), p.nbytes),
            }
            accepted = float(verify(p, ids, q, num_draft, gens).num_accepted.float().mean())
            for mode, (fn, nbytes) in modes.items():
                seconds = median_seconds(fn, repeats, device=device)
                gbps = nbytes / seconds / 1e9
                rows.append({"B": b, "V": v, "mode": mode, "ms": seconds * 1e3,
                             "MB": nbytes / 1e6, "gbps": gbps,
                             "us_per_req": seconds * 1e6 / b, "accepted": accepted})
    after = copy_gbps(copy_bytes, repeats, device)
    bandwidth = max(before, after)  # the machine is shared: compare with its best copy rate
    for r in rows:
        r["ratio"] = r["gbps"] / bandwidth
    return [{"copy_gbps": bandwidth, "copy_runs": (before, after), "copy_bytes": copy_bytes,
             "device": device}, *rows]


def to_markdown(result: list[dict], repeats: int) -> str:
    head, rows = result[0], result[1:]
    device = head.get("device", "cpu")
    where = (f"{torch.cuda.get_device_name(device)} ({device})"
             if torch.device(device).type == "cuda" else
             f"{platform.machine()}, {torch.get_num_threads()} torch threads")
    lines = [
        "# bench-verify: trtspec.spec.sample.verify vs memory bandwidth",
        "",
        f"Machine: {where}, torch {torch.__version__}. Median of {repeats} calls after 2 "
        f"warm-ups, K = {K}.",
        f"Large copy in the same run: **{head['copy_gbps']:.1f} GB/s** (read + write of "
        f"{head['copy_bytes'] / 2**20:.0f} MiB fp32; best of "
        f"{head['copy_runs'][0]:.1f} before and {head['copy_runs'][1]:.1f} after the sweep).",
        "",
        "GB/s = bytes of the inputs handed to verify (p [B,K+1,V] fp32, plus q [B,K,V] in the "
        "sampled mode) / time. The sampled and point-mass paths read p and q only at the drafted "
        "tokens plus the one row where the round stops, so they can beat a full read; greedy "
        "reads all of p once for a blocked argmax (trtspec.spec.sample.probs.argmax; torch's own "
        "CPU argmax ran ~4× slower here). At B = 1 the time is per-op dispatch, not bytes.",
        "",
        "| B | V | mode | ms / call | µs / request | p+q MB | GB/s | × copy GB/s |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['B']} | {r['V']} | {r['mode']} | {r['ms']:.3f} | "
                     f"{r['us_per_req']:.1f} | {r['MB']:.1f} | {r['gbps']:.1f} | "
                     f"{r['ratio']:.2f} |")
    mean_acc = statistics.mean(r["accepted"] for r in rows)
    lines += ["", f"Mean accepted drafts per round in these inputs: {mean_acc:.2f} of {K}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench-verify.md"))
    parser.add_argument("--device", default="cpu", help="torch device of every tensor: cpu "
                        "(default), cuda or cuda:N")
    args = parser.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"bench_verify: --device {args.device}, but torch sees no CUDA device\n")
    if args.quick:
        sizes_b, sizes_v, repeats, copy_bytes = [1, 8], [1000], 3, 16 * 2**20
    else:
        sizes_b, sizes_v, repeats, copy_bytes = [1, 8, 64], [32000, 128256], 15, 1024 * 2**20
    result = run(sizes_b, sizes_v, repeats, copy_bytes, args.device)
    text = to_markdown(result, repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
