"""Hand-built eval records with a chosen TPOT per arm: the decide, report and audit tests'
fixtures."""

from __future__ import annotations

import numpy as np


def record(condition: str, arm: str, rid: str, tpot: float, ttft: float = 0.05, n: int = 64,
           category: str = "c", digest: str = "x", rounds: int = 0, proposed: int = 0,
           accepted: int = 0) -> dict:
    times = [ttft + i * tpot for i in range(n)]
    return {"condition": condition, "arm": arm, "request_id": rid, "category": category,
            "token_times_s": times, "output_tokens": n, "e2e_s": times[-1], "ttft_s": ttft,
            "output_digest": digest, "verification_rounds": rounds, "proposed_tokens": proposed,
            "accepted_draft_tokens": accepted}


def paired(condition: str, base_tpot: float, spec_tpot: float, n: int = 40, noise: float = 0.02,
           seed: int = 0, **spec_kw) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        b = base_tpot * (1 + noise * rng.standard_normal())
        s = spec_tpot * (1 + noise * rng.standard_normal())
        out += [record(condition, "baseline", f"r{i}", b),
                record(condition, "spec", f"r{i}", s, **spec_kw)]
    return out
