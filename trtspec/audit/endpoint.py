"""Exactness audit of any OpenAI-compatible server: does the speculating server emit the same
output distribution as the same model served without speculation?

The in-process audit (:mod:`trtspec.audit.inprocess`) knows the target's exact probabilities. A
server does not tell them, so this audit compares two servers instead: the *endpoint* (speculating)
and the *baseline* (plain decoding of the same model). It is a two-sample test, and it says
nothing about which one is wrong, only that they differ.

Terms:

* outcome      what one request returned for the first ``k`` output tokens: the completion's
               text with ``max_tokens = k``, and whether it ended before ``k`` tokens (finish
               reason other than ``length``: an EOS or a stop). A shorter completion is an
               outcome of its own (``ignore_eos``-style options are not portable)
* sample       one completions request at temperature T with its own ``seed``. The two
               servers get disjoint seeds (endpoint ``seed + i``, baseline ``seed + N + i``),
               so their samples are independent even when both map a seed to the same random
               stream (identical outputs per seed would make the test blind)
* pooled count an outcome's count over both samples, c_i = a_i + b_i (N = n_a + n_b)
* bins         the most frequent outcomes by pooled count (ties broken by the outcome itself),
               as long as the smaller sample expects ≥ ``MIN_EXPECTED`` of each
               (min(n_a, n_b)·c_i / N ≥ 5), at most ``MAX_BINS − 1`` of them; every other
               outcome goes into one *tail* bin (joined to the smallest bin when the tail
               expects < 5 itself). The choice reads the pooled counts only, which are the
               same whichever server is called which, and which under H₀ carry no
               information about how the outcomes split between the servers (given them, the
               split is hypergeometric), so choosing bins from them does not bias the test
* test         Pearson's chi-square test of homogeneity of the 2 × m table (m bins):
               X² = Σ_s Σ_i (O_si − E_si)² / E_si, E_si = n_s·c_i / N, dof = m − 1; H₀: both
               servers draw from one distribution
* combined     prompts are independent, so under H₀ the sum of their X² is chi-square with the
               sum of their dof: one p-value for the audit. A sum (rather than Holm over the
               prompts' p-values) because a defect of a sampler (a wrong temperature, a wrong
               acceptance rule) acts on every prompt, and the sum accumulates that evidence;
               and because its power against an effect on every prompt is exactly the
               noncentral chi-square below. The audit passes when p ≥ α
* effect       ε, the total variation ½ Σ_i |P_a(i) − P_b(i)| between the two servers' *binned*
               outcome distributions (binning can only hide a difference: it is a lower bound
               of the outcome-level TV)
* power        the chance the audit fails when every prompt differs by ε, from the noncentral
               chi-square with the combined dof and λ = Σ_prompts N_eff·Σ_i Δ_i² / p_i
               (N_eff = n_a·n_b / N, p_i = c_i / N the pooled bin distribution, Δ = P_a − P_b).
               Δ is the *least favourable* difference of TV ε: +ε·p_i/P(S) on a set of bins S
               and −ε·p_i/(1 − P(S)) on the rest, with P(S) as near ½ as the bins allow
               (Cauchy–Schwarz: no Δ of TV ε has a smaller Σ Δ²/p), so λ = N_eff·ε²·(1/P(S) +
               1/(1 − P(S))) ≥ 4·ε²·N_eff, and the power holds for every difference of TV ε
* weak         power < ``MIN_POWER``, or (where the server says which samples had a draft
               rejected, as ``trtspec serve`` does) fewer than ``MIN_REJECTED`` samples with a
               rejection: a wrong residual distribution only shows after a rejection. A pass
               of a weak audit cannot support a GO
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trtspec.analysis.gof import chi_square_power as power
from trtspec.analysis.gof import least_favourable
from trtspec.audit.file import write_audit

SAMPLES = 2000  # per server and prompt: λ ≥ 4·0.1²·1000 = 40, power ≈ 0.9 at 20 bins, α 1e-3
TOKENS = 3  # k: the first tokens compared
EFFECT = 0.1  # TV the power is stated against
MIN_POWER = 0.8
MIN_REJECTED = 50  # samples with a rejected draft, as the in-process audit asks
MIN_EXPECTED = 5.0
MAX_BINS = 20  # more bins add dof, and so cost power against the least favourable Δ
WORKERS = 8
# The endpoint audit's built-in prompt (short: each sample is a request to a server): it
# invites copying, so n-gram lookup and suffix trees propose, and at temperature 1 the target
# often leaves the pattern, so drafts are rejected.
PROMPTS = ("Colours: red, green, blue, red, green, blue, red, green, blue, red,",)
METHOD = "endpoint"  # an endpoint eval's conditions are endpoint/D…/c…: decide looks it up

Outcome = tuple[str, bool]  # (text of the first k tokens, ended before k tokens)
Progress = Callable[[str, int, int], None]


class EndpointError(RuntimeError):
    """A server that failed a request or could not be reached: one line."""


@dataclass
class Table:
    """The bins of one prompt and each server's counts in them."""

    bins: list[list[Outcome]]  # each bin's outcomes; the last may be the tail
    a: list[int]
    b: list[int]
    tail: bool  # the last bin pools the rest


def choose_bins(a: Counter[Outcome], b: Counter[Outcome], min_expected: float = MIN_EXPECTED,
                max_bins: int = MAX_BINS) -> Table:
    """Bins from the pooled counts (module docstring): symmetric in ``a`` and ``b``."""
    n_a, n_b = sum(a.values()), sum(b.values())
    n = n_a + n_b
    pooled = a + b
    order = sorted(pooled, key=lambda o: (-pooled[o], o))
    small = min(n_a, n_b)
    kept = [o for o in order if small * pooled[o] / n >= min_expected][: max_bins - 1] \
        if n else []
    bins = [[o] for o in kept]
    rest = order[len(kept):]
    tail = bool(rest)
    if rest:
        if small * sum(pooled[o] for o in rest) / n >= min_expected or not bins:
            bins.append(rest)
        else:  # a tail too small for a bin of its own joins the smallest bin
            bins[-1] = bins[-1] + rest
            tail = False
    return Table(bins, [sum(a[o] for o in g) for g in bins],
                 [sum(b[o] for o in g) for g in bins], tail)


def homogeneity(a: Sequence[float], b: Sequence[float]) -> tuple[float, int]:
    """Pearson's X² of the 2 × m table (rows a, b) and its dof m − 1 (0, 0 for m < 2)."""
    n_a, n_b = float(sum(a)), float(sum(b))
    n = n_a + n_b
    if len(a) < 2 or n_a == 0 or n_b == 0:
        return 0.0, 0
    stat = 0.0
    for x, y in zip(a, b, strict=True):
        c = x + y
        for o, n_s in ((x, n_a), (y, n_b)):
            e = n_s * c / n
            stat += (o - e) ** 2 / e if e > 0 else 0.0
    return stat, len(a) - 1


def noncentrality(table: Table, effect: float) -> float:
    """λ of one prompt against the least favourable difference of TV ``effect``."""
    n_a, n_b = sum(table.a), sum(table.b)
    if n_a == 0 or n_b == 0 or len(table.bins) < 2:
        return 0.0
    pooled = [x + y for x, y in zip(table.a, table.b, strict=True)]
    return n_a * n_b / (n_a + n_b) * effect ** 2 * least_favourable(pooled)


def p_value(stat: float, dof: int) -> float:
    from scipy.stats import chi2

    return float(chi2.sf(stat, dof)) if dof > 0 else 1.0


@dataclass
class Drawn:
    """One server's samples of one prompt."""

    outcomes: list[Outcome]
    draft_len: int | str = "unknown"  # what the server said it speculates with
    speculated: float = math.nan  # share with a drafting round (trtspec serve's ``spec``)
    rejected: float = math.nan  # share with a rejected draft


@dataclass
class PromptTest:
    """One prompt: both servers' samples in bins, its own X² and what it adds to λ."""

    prompt: str
    samples: int  # per server
    outcomes: int  # distinct outcomes seen, both servers
    bins: int
    tail: bool
    chi2: float
    dof: int
    p_value: float
    noncentrality: float
    tv: float  # observed TV between the two binned empirical distributions
    ended_early: list[float]  # share of shorter completions: [endpoint, baseline]
    speculated: float
    rejected: float
    draft_len: int | str
    top: list[dict[str, Any]] = field(default_factory=list)  # the largest bins, for reading
    seconds: float = 0.0


def compare_prompt(label: str, spec: Drawn, base: Drawn, effect: float, seconds: float = 0.0
                ) -> PromptTest:
    """Bins, X² and λ of one prompt's two samples."""
    a, b = Counter(spec.outcomes), Counter(base.outcomes)
    table = choose_bins(a, b)
    stat, dof = homogeneity(table.a, table.b)
    n_a, n_b = max(len(spec.outcomes), 1), max(len(base.outcomes), 1)
    tv = 0.5 * sum(abs(x / n_a - y / n_b) for x, y in zip(table.a, table.b, strict=True))
    top = [{"text": g[0][0], "ended_early": g[0][1], "endpoint": x, "baseline": y}
           for g, x, y in list(zip(table.bins, table.a, table.b, strict=True))[:5]
           if len(g) == 1]
    early = [sum(o[1] for o in s.outcomes) / max(len(s.outcomes), 1) for s in (spec, base)]
    return PromptTest(label, len(spec.outcomes), len(a + b), len(table.bins), table.tail, stat,
                      dof, p_value(stat, dof), noncentrality(table, effect), tv, early,
                      spec.speculated, spec.rejected, spec.draft_len, top, seconds)


def draw(url: str, model: str, prompt: str, tokens: int, temperature: float, seeds: Sequence[int],
         workers: int = WORKERS, tick: Callable[[], None] | None = None,
         extra: dict[str, Any] | None = None) -> Drawn:
    """One completions request per seed through the real ``openai`` client, ``workers`` at a
    time; the first failure stops the draw with one line."""
    from openai import APIError, OpenAI

    from trtspec.eval.endpoint import announced_draft_len

    client = OpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                    max_retries=2, timeout=60.0)

    def one(seed: int) -> tuple[Outcome, dict[str, Any]]:
        try:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=tokens,
                                          temperature=temperature, seed=seed,
                                          extra_body=extra or None)
        except APIError as e:
            why = str(e).splitlines()[0] if str(e) else ""
            raise EndpointError(f"{url}: {type(e).__name__}: {why}"[:300]) from None
        if tick:
            tick()
        choice = r.choices[0]
        return (choice.text, choice.finish_reason != "length"), r.model_extra or {}

    pool = ThreadPoolExecutor(workers)
    try:
        futures = [pool.submit(one, s) for s in seeds]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        got = [f.result() for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        client.close()
    drawn = Drawn([o for o, _ in got])
    extras = [x for _, x in got]
    drawn.draft_len = announced_draft_len(extras[0]) if extras else "unknown"
    specs = [x.get("spec") for x in extras]
    if specs and all(isinstance(s, dict) and "proposed_tokens" in s for s in specs):
        drawn.speculated = sum(s["proposed_tokens"] > 0 for s in specs) / len(specs)
        drawn.rejected = sum(s["accepted_draft_tokens"] < s["proposed_tokens"]
                             for s in specs) / len(specs)
    return drawn


def run_endpoint_audit(endpoint: str, baseline: str, model: str | None = None,
                       prompts: Sequence[str] = (), samples: int = SAMPLES,
                       tokens: int = TOKENS, temperature: float = 1.0, alpha: float = 1e-3,
                       effect: float = EFFECT, seed: int = 0, out: str | Path | None = None,
                       top_p: float = 1.0, top_k: int = 0, workers: int = WORKERS,
                       progress: Progress | None = None,
                       say: Callable[[str], None] | None = None
                       ) -> tuple[Path, dict[str, Any]]:
    """Audit ``endpoint`` against ``baseline`` on each prompt; writes ``audit.json`` (the
    in-process audit's shape, ``kind: endpoint``) into ``out``."""
    from scipy.stats import chi2

    from trtspec.eval.endpoint import EndpointUnreachable, check_reachable

    for url in (endpoint, baseline):
        try:
            check_reachable(url)
        except EndpointUnreachable as e:
            raise EndpointError(str(e).replace("Nothing was written", "nothing was audited")) \
                from None
    model = model or _served_model(endpoint)
    texts = list(prompts) or list(PROMPTS)
    total = 2 * samples * len(texts)
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress:
            progress(METHOD, done[0], total)

    if progress:
        progress(METHOD, 0, total)
    if say:
        say(f"audit: {samples} samples of the first {tokens} tokens per server and prompt "
            f"({len(texts)} prompt(s)), {workers} requests at a time")
    extra = {k: v for k, v in (("top_p", top_p if top_p != 1.0 else None),
                               ("top_k", top_k or None)) if v is not None}
    results = []
    for j, text in enumerate(texts):
        began = time.perf_counter()
        first = seed + 2 * samples * j
        spec = draw(endpoint, model, text, tokens, temperature,
                    range(first, first + samples), workers, tick, extra)
        base = draw(baseline, model, text, tokens, temperature,
                    range(first + samples, first + 2 * samples), workers, tick, extra)
        label = text if len(text) <= 60 else text[:57] + "…"
        results.append(compare_prompt(label, spec, base, effect, time.perf_counter() - began))
    stat = sum(r.chi2 for r in results)
    dof = sum(r.dof for r in results)
    lam = sum(r.noncentrality for r in results if r.dof > 0)
    p = p_value(stat, dof)
    pw = power(dof, lam, alpha)
    d = results[0].draft_len if results else "unknown"
    told = [r for r in results if r.rejected == r.rejected]  # the server said (not NaN)
    rejections = round(sum(r.rejected * r.samples for r in told)) if told else MIN_REJECTED
    method = {"method": METHOD, "draft_lengths": [d], "passed": p >= alpha,
              "weak": pw < MIN_POWER or rejections < MIN_REJECTED, "rejections": rejections,
              "threshold": alpha, "p_value": p, "chi2": stat,
              "dof": dof, "critical": float(chi2.isf(alpha, dof)) if dof else math.inf,
              "noncentrality": lam, "power": pw, "effect": effect, "combine": "sum",
              "prompts": [asdict(r) for r in results]}
    report = {"kind": "endpoint", "endpoint": endpoint, "baseline_endpoint": baseline,
              "model": model, "alpha": alpha, "samples": samples, "tokens": tokens,
              "draft_len": str(d), "draft_lengths": [d], "effect": effect,
              "min_power": MIN_POWER, "power": pw,
              "sampling": {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                           "seed": seed, "max_tokens": tokens},
              "methods": {METHOD: method}}
    target = Path(out) if out else Path("reports") / (
        f"endpoint-audit-{time.strftime('%Y%m%d-%H%M%S')}")
    target.mkdir(parents=True, exist_ok=True)
    write_audit(target, report)
    return target, report


def _served_model(url: str) -> str:
    """The first model /v1/models lists (the name to send when none is given)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/models", timeout=10) as r:
            return str(json.loads(r.read())["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        raise EndpointError(f"{url}: /models names no model: pass --model") from None


def markdown_lines(audit: dict[str, Any]) -> list[str]:
    """The report's audit table for an endpoint audit (``kind: endpoint``)."""
    m = audit["methods"][METHOD]
    s = audit["sampling"]
    result = ("PASS" if m["passed"] else "FAIL") + (
        f" (weak: power {m['power']:.2f}, {m.get('rejections', '?')} samples after a "
        "rejection)" if m["weak"] else "")
    lines = [f"{audit['endpoint']} against {audit['baseline_endpoint']} (model {audit['model']}, "
             f"temperature {s['temperature']}): {audit['samples']} samples per server and "
             f"prompt of the first {audit['tokens']} tokens; chi-square of homogeneity over "
             "the most frequent outputs (pooled tail), summed over prompts: X² = "
             f"{m['chi2']:.1f} on {m['dof']} dof, p = {m['p_value']:.3g} (α = "
             f"{audit['alpha']}); power {m['power']:.2f} against a total variation of "
             f"{m['effect']} between the servers' binned outputs. **{result}**", "",
             "| prompt | outcomes seen | bins | X² | dof | p-value |",
             "|---|---:|---:|---:|---:|---:|"]
    for p in m["prompts"]:
        lines.append(f"| {p['prompt'].replace('|', '/')} | {p['outcomes']} | {p['bins']} | "
                     f"{p['chi2']:.1f} | {p['dof']} | {p['p_value']:.3g} |")
    return lines


def audit_of_this_eval(audit: dict[str, Any] | None, eval_dir: str | Path) -> bool:
    """Whether ``audit`` (an eval folder's audit.json) tested the servers and model that
    endpoint eval measured: an audit of other servers cannot gate its verdicts."""
    from trtspec.eval.folder import meta_if_any

    if not audit or audit.get("kind") != "endpoint":
        return False
    meta = meta_if_any(Path(eval_dir))

    def same(a: Any, b: Any) -> bool:
        return not a or not b or str(a).rstrip("/") == str(b).rstrip("/")

    return all(same(audit.get(k), meta.get(k)) for k in ("endpoint", "baseline_endpoint",
                                                         "model"))
