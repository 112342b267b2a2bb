"""Exactness audit: does speculative sampling, as it runs in serve and eval, emit the target's
distribution on the *actual* models?

It samples the way eval and serve run: through the :class:`~trtspec.serve.scheduler.Scheduler`,
``limits.max_batch_size`` slots, requests admitted between rounds while others are mid-decode,
at the eval's draft lengths (the largest fixed D, and adaptive when the recipe lists it), with
cross-request state (a suffix tree, the adaptive prior) populated by earlier requests. Per
method, D and prompt (a *test*) it draws N seeded samples of the first four output tokens
x₀ … x₃ — so a token drawn after a rejection and the rollback of the shared cache is tested
too — and compares them with their exact probabilities by a chi-square test.
:mod:`trtspec.audit.sampling` defines x₀ … x₃, sample, warm request, speculated, recovered,
rejected, staggered, cells and bins.

Terms:

* prompt      the built-in one: a long list of cars of random colours (:func:`car_park`,
              ≥ ``LONG_POSITIONS`` tokens), so that every cache a method uses (the target's, a
              draft model's, an EAGLE head's, a suffix tree's) holds that many positions before
              the sampled tokens; it invites copying, so n-gram lookup and suffix trees propose,
              and which colour comes next is a guess, so most samples see a rejection (a high
              r, below). ``--prompt`` replaces it. A prompt of ``KEEP_FROM`` tokens or more
              keeps its KV cache in each slot between samples (the scheduler's *kept prompt*),
              so it is prefilled once per slot, not once per sample (a draft model's cache and
              an EAGLE head's keep it too). That admission is the audit's own: serve and eval
              prefill every prompt
* method test the chi-squares and degrees of freedom of a method's tests summed: one p-value
              per method. A sum, because a defect of a sampler acts on every prompt and D, and
              the sum accumulates that evidence; and because its power is exactly the
              noncentral chi-square below. A method passes when p ≥ α / methods
              (Bonferroni), so a correct sampler fails the audit with probability ≤ α
* effect      ε (``EFFECT``, 0.1): the total variation between the distribution a recovered
              token is drawn from and the right one, norm(max(0, p − q)). Only the share r of
              samples with a recovered token (``recovered``) carries it, so the samples' own
              distribution is off by r·ε (exactly so for an error at one position, with the
              same ε after every prefix; spread over positions it can be more). The power is
              stated for a difference of r·ε *between the bins* (binned TV): a difference
              within a bin is invisible to the test, so binning can only hide one
* power       the chance the method test fails when every test is off by r·ε: noncentral
              chi-square with the summed dof and λ = Σ_tests N·(r·ε)²·L, L = min over sets S of
              bins of 1/P(S) + 1/(1 − P(S)) (:func:`~trtspec.analysis.gof.least_favourable`: the
              least favourable difference of that size, so the power holds for every one)
* weak        power < ``MIN_POWER`` or fewer than ``MIN_REJECTIONS`` recovered samples: the
              audit could not have seen a wrong residual. A weak PASS supports no GO
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trtspec.analysis.gof import chi_square_power
from trtspec.audit.file import write_audit
from trtspec.audit.sampling import MAX_BINS, TOKENS, draw, exact_fit
from trtspec.runtime import Runner
from trtspec.runtime.trtllm_stream import LlmArm
from trtspec.spec.adaptive import ADAPTIVE
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.sample.probs import SamplingParams

MIN_REJECTIONS = 50
SAMPLES = 1600  # per test: power ≈ 0.89 at r = 0.87, 30 bins, one test a method (0.86 with
# two: a fixed D and adaptive); docs/audit.md says what the demo recipe's audit costs
EFFECT = 0.1
MIN_POWER = 0.8
LONG_POSITIONS = 600
KEEP_FROM = 256
TEST_SEEDS = 1 << 24  # seeds per test: samples, then warm requests (fewer than slots + samples)
COLOURS = ("red", "blue", "green", "white", "black", "silver", "grey", "yellow", "orange",
           "brown", "purple", "pink")


def car_park(encode: Callable[[str], Sequence[int]], positions: int = LONG_POSITIONS) -> str:
    """The long built-in prompt: cars of random colours (seeded, so every audit sends the same
    text), long enough for ``positions`` tokens. It invites copying (the colours repeat), yet
    which colour comes next is a guess, so drafts are proposed and mostly rejected."""
    rng = random.Random(0)
    cars: list[str] = []
    while True:
        cars += [f"{rng.choice(COLOURS)} car" for _ in range(40)]
        text = "Cars in the car park, by colour: " + ", ".join(cars) + ","
        if len(encode(text)) >= positions:
            return text


Progress = Callable[[str, int, int], None]  # (method, samples drawn, samples to draw)


@dataclass
class PromptAudit:
    """One test: a prompt at one D (field meanings: :mod:`trtspec.audit.sampling`)."""

    prompt: str
    draft_len: int | str
    samples: int
    speculated: float  # fraction of samples with a draft in a round that made x₁ … x₃
    recovered: float  # fraction with a token among x₁ … x₃ recovered after a rejection
    rejected: float  # fraction whose x₃ was drawn after a rejection (x₁ or x₂ recovered)
    staggered: float  # fraction admitted while another request was mid-decode
    chi2: float
    dof: int
    p_value: float  # this test alone, for reading: the verdict is the method's
    bins: int  # the bins of the chi-square (:mod:`trtspec.audit.sampling`)
    least_favourable: float  # L of the bins: min_S 1/P(S) + 1/(1 − P(S))
    noncentrality: float  # this test's part of λ at the audit's effect: N·(r·ε)²·L
    positions: int  # the prompt's tokens: positions before the sampled ones
    kept_prompt: bool  # a slot kept the prompt's KV cache between samples
    seconds: float  # sampling and exact probabilities


@dataclass
class MethodAudit:
    method: str
    draft_lengths: list[int | str]
    passed: bool
    weak: bool
    threshold: float  # the method test's level: α / methods
    chi2: float  # summed over the method's tests
    dof: int
    p_value: float
    effect: float  # ε, the post-rejection total variation the power is stated against
    power: float
    min_power: float  # below it: weak
    recovered_samples: int  # samples with a recovered token, all its tests (weak: too few)
    rejected_samples: int  # samples whose x₃ came after a rejection, all its tests
    prompts: list[PromptAudit] = field(default_factory=list)  # one per (D, prompt)


def audit_prompt(executor: SpecExecutor | LlmArm, prompt: Sequence[int],
                 params: SamplingParams, samples: int, slots: int, label: str = "",
                 draft_len: int | str | None = None,
                 progress: Callable[[int], None] | None = None, effect: float = EFFECT,
                 reference: Callable[[], Runner] | None = None) -> PromptAudit:
    """Draw ``samples`` of x₀ … x₃ through a scheduler of ``slots`` slots on ``executor`` and
    test them against the exact joint distribution computed from its target, or, for an
    LlmArm (TensorRT-LLM's batch samples), from ``reference()``: the target's raw logits."""
    began = time.perf_counter()
    keep = len(prompt) >= KEEP_FROM
    drawn = draw(executor, prompt, params, samples, slots, progress=progress, keep_prompt=keep)
    if isinstance(executor, SpecExecutor):
        target = executor.target
    elif reference is not None:
        target = reference()
    else:
        raise ValueError("auditing TensorRT-LLM's batch needs a reference runner")
    fit = exact_fit(target, prompt, params, drawn.sequences, rows=slots)
    d = draft_len if draft_len is not None else (
        ADAPTIVE if getattr(executor, "adaptive", None) is not None else executor.draft_len)
    r = drawn.recovered / samples
    lam = samples * (r * effect) ** 2 * fit.least_favourable if fit.dof else 0.0
    return PromptAudit(label, d, samples, drawn.speculated / samples, r,
                       drawn.rejected / samples, drawn.staggered / samples, fit.chi2, fit.dof,
                       fit.p_value, fit.bins, fit.least_favourable, lam, len(prompt), keep,
                       time.perf_counter() - began)


def method_verdict(method: str, draft_lengths: Sequence[int | str],
                   results: Sequence[PromptAudit], alpha: float, methods: int,
                   effect: float = EFFECT) -> MethodAudit:
    """One method's tests summed into its test (module docstring), at level α / methods."""
    from scipy.stats import chi2

    threshold = alpha / methods
    stat = sum(r.chi2 for r in results)
    dof = sum(r.dof for r in results)
    p = 0.0 if stat == float("inf") else float(chi2.sf(stat, dof)) if dof else 1.0
    power = chi_square_power(dof, sum(r.noncentrality for r in results), threshold)
    recovered = sum(round(r.recovered * r.samples) for r in results)
    return MethodAudit(method, list(draft_lengths), passed=p >= threshold,
                       weak=power < MIN_POWER or recovered < MIN_REJECTIONS,
                       threshold=threshold, chi2=stat, dof=dof, p_value=p, effect=effect,
                       power=power, min_power=MIN_POWER, recovered_samples=recovered,
                       rejected_samples=sum(round(r.rejected * r.samples) for r in results),
                       prompts=list(results))


def audit_method(method: str, executors: Callable[[int | str], SpecExecutor | LlmArm],
                 draft_lengths: Sequence[int | str], prompts: Sequence[Sequence[int]],
                 labels: Sequence[str], params: SamplingParams, samples: int, slots: int,
                 alpha: float, methods: int, progress: Callable[[int], None] | None = None,
                 effect: float = EFFECT, reference: Callable[[], Runner] | None = None
                 ) -> MethodAudit:
    """Every (D, prompt) test of one method and its verdict; ``executors(D)`` makes its
    executor at D (one per D: the prompts run on it in turn, nothing forgotten between);
    ``reference``: the exact runner an LlmArm's samples are tested against."""
    results = []
    for d in draft_lengths:
        executor = executors(d)
        for p, label in zip(prompts, labels, strict=True):
            # seeds of their own per test: tests that shared seeds would share x₀ (and much
            # of x₁ … x₃), and their summed chi-square would not be chi-square
            seeded = params.model_copy(update={"seed": (params.seed or 0) +
                                               len(results) * TEST_SEEDS})
            results.append(audit_prompt(executor, p, seeded, samples, slots, label, d,
                                        progress, effect, reference))
    return method_verdict(method, draft_lengths, results, alpha, methods, effect)


def audit_params(sampling: SamplingParams, temperature: float | None = None) -> SamplingParams:
    """The recipe's sampling, at temperature 1 when the recipe is greedy (greedy exactness is
    the greedy-identity gate's job; the audit needs a distribution)."""
    t = temperature if temperature is not None else (sampling.temperature or 1.0)
    return sampling.model_copy(update={"temperature": t})


def audit_lengths(lengths: Sequence[int | str]) -> list[int | str]:
    """The D's an audit runs from an eval's draft lengths: the largest fixed one (the longest
    accepted runs, the most positions a rejection can hit) and adaptive when listed."""
    fixed = [d for d in lengths if d != ADAPTIVE and int(d) > 0]
    return ([max(int(d) for d in fixed)] if fixed else []) + \
        ([ADAPTIVE] if ADAPTIVE in lengths else [])


def run_audit(source: str | Path, overrides: Sequence[str] = (),
              engines_root: str | Path = "engines", out: str | Path | None = None,
              prompts: Sequence[str] = (), samples: int = SAMPLES,
              draft_lengths: Sequence[int | str] = (), temperature: float | None = None,
              alpha: float = 1e-3, progress: Progress | None = None,
              say: Callable[[str], None] | None = None, effect: float = EFFECT
              ) -> tuple[Path, dict[str, Any]]:
    """Audit every speculative method of an eval folder (the models and draft lengths it
    measured) or a recipe (its build); writes ``audit.json`` into the eval folder or ``out``.
    ``draft_lengths`` overrides the D's (:func:`audit_lengths` of the recipe's); ``prompts``
    replace the built-in ones."""
    from trtspec.build.manifest import load_manifest, open_built
    from trtspec.build.open import check_in_process, open_models
    from trtspec.build.recipe import load_recipe
    from trtspec.eval import eval_recipe, in_process

    source = Path(source)
    if source.is_dir():
        recipe = eval_recipe(source)
        check_in_process(recipe, source)
        if not in_process(source):
            raise ValueError(f"{source}: no manifest.json: an endpoint eval cannot be audited "
                             "here (audit the server's build recipe instead)")
        manifest = load_manifest(source / "manifest.json")
        target_dir = Path(out) if out else source
    else:
        recipe = load_recipe(source, overrides)
        check_in_process(recipe, source)  # torch, or TensorRT-LLM's LLM API
        manifest, _ = open_built(recipe, source, engines_root)
        target_dir = Path(out) if out else Path("reports") / (
            f"{recipe.name}-audit-{time.strftime('%Y%m%d-%H%M%S')}")
    lengths = list(draft_lengths) or audit_lengths(
        recipe.condition_draft_lengths(manifest.draft_lengths))
    params = audit_params(recipe.sampling.params(), temperature)
    slots = recipe.limits.max_batch_size
    build = open_models(recipe, manifest, source)
    if say:
        say(f"audit: opening {recipe.name}'s models ({slots} slots) …")
    texts = list(prompts) or [car_park(lambda t: build.encode(t, chat=False))]
    ids = [build.encode(t, chat=False) for t in texts]
    limit = recipe.limits.max_input_len
    if any(len(i) > limit for i in ids) and say:
        say(f"audit: limits.max_input_len is {limit}: a prompt longer than that is cut to "
            f"its first {limit} tokens" + ("" if prompts else
                                           f" (the built-in one wants {LONG_POSITIONS})"))
    ids = [i[:limit] for i in ids]
    native = recipe.backend.kind == "trtllm" and recipe.backend.mode != "exact"
    if native:
        build.share_gpu(2)  # the arm audited, and the plain one the reference reads
    else:
        build.warm_up(slots)  # the scheduler's batch, as eval and serve run it
    labels = [(t if len(t) <= 60 else t[:57] + "…") + f" ({len(i)} tokens)"
              for t, i in zip(texts, ids, strict=True)]
    methods = build.method_names
    per_method = samples * len(texts) * len(lengths)
    results = []
    for m in methods:
        done = 0

        def tick(n: int, m: str = m) -> None:
            nonlocal done
            done += n
            if progress:
                progress(m, done, per_method)

        if progress:
            progress(m, 0, per_method)
        results.append(audit_method(m, lambda d, m=m: build.arm(m, d), lengths, ids,
                                    labels, params, samples, slots, alpha, len(methods), tick,
                                    effect, build.reference if native else None))
    build.release_arms()
    report = {"recipe": recipe.name, "alpha": alpha, "samples": samples, "effect": effect,
              "min_power": MIN_POWER,
              "draft_len": ", ".join(str(d) for d in lengths), "draft_lengths": lengths,
              "tokens": TOKENS, "slots": slots, "sampling": params.model_dump(mode="json"),
              "methods": {r.method: asdict(r) for r in results}}
    target_dir.mkdir(parents=True, exist_ok=True)
    write_audit(target_dir, report)
    return target_dir, report


def markdown_lines(audit: dict[str, Any]) -> list[str]:
    """An in-process audit.json as the report's "Exactness audit" section shows it."""
    lines: list[str] = []
    s = audit["sampling"]
    tokens = audit.get("tokens", 2)  # audits before x₀ … x₃ through the scheduler tested two
    through = (f" through the serving scheduler ({audit['slots']} slots, staggered admissions)"
               if "slots" in audit else "")
    if "effect" not in audit:  # an audit before method tests and stated power
        return lines + _per_test_lines(audit, tokens, through, s)
    lines += [f"{audit['samples']} samples per test (a method at one D on one prompt) of the "
              f"first {tokens} output tokens{through} at D = {audit['draft_len']}, temperature "
              f"{s['temperature']}, top-k {s['top_k']}, top-p {s['top_p']}, compared with the "
              f"target's exact joint probability by chi-square in at most {MAX_BINS} bins. A "
              "method's "
              f"tests are summed into one test at α / methods (α = {audit['alpha']}). **Power** "
              "is the chance it fails when the distribution a token is recovered from after a "
              f"rejection is off by a total variation of {audit['effect']}, as far as the bins "
              "see it (the samples with a recovered token carry the error; a difference "
              "between cells of one bin is invisible); below "
              f"{audit.get('min_power', MIN_POWER)} the audit is **weak** and supports no GO.",
              "", "| method | result | p-value | level | χ² / dof | power | samples with a "
              "recovered token |", "|---|---|---:|---:|---:|---:|---:|"]
    for method, m in audit["methods"].items():
        lines.append(f"| {method} | {_result(m)} | {m['p_value']:.3g} | {m['threshold']:.2g} | "
                     f"{m['chi2']:.1f} / {m['dof']} | {m['power']:.2f} | "
                     f"{m['recovered_samples']} |")
    lines += ["", "| method | D | prompt | positions | p-value (alone) | speculated | "
              "recovered | x₃ after a rejection |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for method, m in audit["methods"].items():
        for p in m["prompts"]:
            prompt = p["prompt"].replace("|", "/")  # a table cell
            lines.append(f"| {method} | {p['draft_len']} | {prompt} | {p['positions']} | "
                         f"{p['p_value']:.3g} | {100 * p['speculated']:.0f} % | "
                         f"{100 * p['recovered']:.0f} % | {100 * p['rejected']:.0f} % |")
    return lines


def _result(m: dict[str, Any]) -> str:
    result = "PASS" if m["passed"] else "FAIL"
    if not m["passed"] or not m.get("weak"):  # a FAIL stands, whatever the power
        return result
    low = m.get("power", 1.0) < m.get("min_power", MIN_POWER)
    return f"{result} (weak: {'low power' if low else 'few rejections'})"


def _per_test_lines(audit: dict[str, Any], tokens: int, through: str, s: dict[str, Any]
                    ) -> list[str]:
    """An audit.json written before method tests: one p-value per test, no power."""
    lines = [f"{audit['samples']} samples per test of the first {tokens} output tokens"
             f"{through} at D = {audit['draft_len']}, temperature {s['temperature']}, top-k "
             f"{s['top_k']}, top-p {s['top_p']}; chi-square with pooled tail against the exact "
             "joint probability; a method passes when every p-value ≥ α / tests (α = "
             f"{audit['alpha']}). No power was stated (an audit of an earlier trtspec).", "",
             "| method | result | D | prompt | p-value | speculated | after a rejection |",
             "|---|---|---|---|---:|---:|---:|"]
    for method, m in audit["methods"].items():
        for p in m["prompts"]:
            prompt = p["prompt"].replace("|", "/")  # a table cell
            d = p.get("draft_len", audit["draft_len"])
            lines.append(f"| {method} | {_result(m)} | {d} | {prompt} | {p['p_value']:.3g} | "
                         f"{100 * p['speculated']:.0f} % | {100 * p['rejected']:.0f} % |")
    return lines
