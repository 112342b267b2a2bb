"""Exactness audit: does speculative sampling, as it runs in serve and eval, emit the target's
distribution on the *actual* models?

It samples the way eval and serve run: through the :class:`~trtspec.scheduler.Scheduler`,
``limits.max_batch_size`` slots, requests admitted between rounds while others are mid-decode,
at the eval's draft lengths (the largest fixed D, and adaptive when the recipe lists it), with
cross-request state (a suffix tree, the adaptive prior) populated by earlier requests. Per
method, D and prompt (a *test*) it draws N seeded samples of the first four output tokens
x₀ … x₃ — so a token drawn after a rejection and the rollback of the shared cache is tested
too — and compares them with their exact probabilities by a chi-square test with a pooled
tail. :mod:`trtspec.audit_sampling` defines x₀ … x₃, sample, warm request, speculated,
rejected, staggered, cells and the pooled tail.

A method passes when every one of its tests has p ≥ α / (number of tests in the audit)
(Bonferroni), so a correct sampler fails the whole audit with probability ≤ α. The audit is
only as strong as the speculation it sees: a method is ``weak`` when fewer than
``MIN_REJECTIONS`` of its samples had a *recovered* token (a wrong residual needs rejections
to show); the *rejected* samples (x₃ drawn after a rejection and rollback) are reported too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trtspec.adaptive import ADAPTIVE
from trtspec.audit_sampling import TOKENS, draw, exact_fit
from trtspec.executor import SpecExecutor
from trtspec.files import write_atomic
from trtspec.sampling import SamplingParams

AUDIT = "audit.json"
MIN_REJECTIONS = 50
SAMPLES = 150  # per test: see the README for what the demo recipe's audit costs
# The built-in prompt (no chat template) invites copying, so n-gram lookup and suffix trees
# propose too, and at temperature 1 the target often leaves the pattern: drafts are rejected.
# One prompt by default: each more costs as much again (--prompt adds others).
PROMPTS = ("Colours: red, green, blue, red, green, blue, red, green, blue, red,",)

Progress = Callable[[str, int, int], None]  # (method, samples drawn, samples to draw)


@dataclass
class PromptAudit:
    """One test: a prompt at one D (field meanings: :mod:`trtspec.audit_sampling`)."""

    prompt: str
    draft_len: int | str
    samples: int
    speculated: float  # fraction of samples with a draft in a round that made x₁ … x₃
    recovered: float  # fraction with a token among x₁ … x₃ recovered after a rejection
    rejected: float  # fraction whose x₃ was drawn after a rejection (x₁ or x₂ recovered)
    staggered: float  # fraction admitted while another request was mid-decode
    chi2: float
    dof: int
    p_value: float
    kept_cells: int  # cells with expected count ≥ 5 (the rest pooled)
    seconds: float  # sampling and exact probabilities


@dataclass
class MethodAudit:
    method: str
    draft_lengths: list[int | str]
    passed: bool
    weak: bool
    threshold: float  # the per-test p-value threshold (α / tests)
    recovered_samples: int  # samples with a recovered token, all its tests (weak: too few)
    rejected_samples: int  # samples whose x₃ came after a rejection, all its tests
    prompts: list[PromptAudit] = field(default_factory=list)  # one per (D, prompt)

    @property
    def p_value(self) -> float:
        return min((p.p_value for p in self.prompts), default=1.0)


def audit_prompt(executor: SpecExecutor, prompt: Sequence[int], params: SamplingParams,
                 samples: int, slots: int, label: str = "", draft_len: int | str | None = None,
                 progress: Callable[[int], None] | None = None) -> PromptAudit:
    """Draw ``samples`` of x₀ … x₃ through a scheduler of ``slots`` slots on ``executor`` and
    test them against the exact joint distribution computed from its target."""
    began = time.perf_counter()
    drawn = draw(executor, prompt, params, samples, slots, progress=progress)
    fit = exact_fit(executor.target, prompt, params, drawn.sequences, rows=slots)
    d = draft_len if draft_len is not None else (
        ADAPTIVE if executor.adaptive is not None else executor.draft_len)
    return PromptAudit(label, d, samples, drawn.speculated / samples,
                       drawn.recovered / samples, drawn.rejected / samples,
                       drawn.staggered / samples, fit.chi2, fit.dof, fit.p_value,
                       fit.kept, time.perf_counter() - began)


def audit_method(method: str, executors: Callable[[int | str], SpecExecutor],
                 draft_lengths: Sequence[int | str], prompts: Sequence[Sequence[int]],
                 labels: Sequence[str], params: SamplingParams, samples: int, slots: int,
                 alpha: float, tests: int, progress: Callable[[int], None] | None = None
                 ) -> MethodAudit:
    """Every (D, prompt) test of one method; ``executors(D)`` makes its executor at D (one per
    D: the prompts run on it in turn, nothing forgotten in between)."""
    threshold = alpha / tests
    results = []
    for d in draft_lengths:
        executor = executors(d)
        results += [audit_prompt(executor, p, params, samples, slots, label, d, progress)
                    for p, label in zip(prompts, labels, strict=True)]
    recovered = sum(round(r.recovered * r.samples) for r in results)
    return MethodAudit(method, list(draft_lengths),
                       passed=all(r.p_value >= threshold for r in results),
                       weak=recovered < MIN_REJECTIONS, threshold=threshold,
                       recovered_samples=recovered,
                       rejected_samples=sum(round(r.rejected * r.samples) for r in results),
                       prompts=results)


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
              say: Callable[[str], None] | None = None) -> tuple[Path, dict[str, Any]]:
    """Audit every speculative method of an eval folder (the models and draft lengths it
    measured) or a recipe (its build); writes ``audit.json`` into the eval folder or ``out``.
    ``draft_lengths`` overrides the D's (:func:`audit_lengths` of the recipe's)."""
    from trtspec.engine import OpenBuild
    from trtspec.eval import eval_recipe, in_process
    from trtspec.manifest import load_manifest, open_built
    from trtspec.recipe import load_recipe

    source = Path(source)
    if source.is_dir():
        recipe = eval_recipe(source)
        if not in_process(source):
            raise ValueError(f"{source}: no manifest.json: an endpoint eval cannot be audited "
                             "here (audit the server's build recipe instead)")
        manifest = load_manifest(source / "manifest.json")
        target_dir = Path(out) if out else source
    else:
        recipe = load_recipe(source, overrides)
        manifest, _ = open_built(recipe, source, engines_root)
        target_dir = Path(out) if out else Path("reports") / (
            f"{recipe.name}-audit-{time.strftime('%Y%m%d-%H%M%S')}")
    if manifest.backend != "torch":
        raise ValueError(f"{source}: the audit runs the in-process torch executor; this build "
                         f"is {manifest.backend}")
    lengths = list(draft_lengths) or audit_lengths(
        recipe.condition_draft_lengths(manifest.draft_lengths))
    params = audit_params(recipe.sampling.params(), temperature)
    slots = recipe.limits.max_batch_size
    build = OpenBuild(recipe, manifest)
    if say:
        say(f"audit: opening {recipe.name}'s models ({slots} slots) …")
    texts = list(prompts) or list(PROMPTS)
    ids = [build.encode(t, chat=False) for t in texts]
    build.warm_up(slots)  # the scheduler's batch, as eval and serve run it
    labels = [t if len(t) <= 60 else t[:57] + "…" for t in texts]
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
        results.append(audit_method(m, lambda d, m=m: build.executor(m, d), lengths, ids,
                                    labels, params, samples, slots, alpha,
                                    len(methods) * len(lengths) * len(texts), tick))
    report = {"recipe": recipe.name, "alpha": alpha, "samples": samples,
              "draft_len": ", ".join(str(d) for d in lengths), "draft_lengths": lengths,
              "tokens": TOKENS, "slots": slots, "sampling": params.model_dump(mode="json"),
              "methods": {r.method: {**asdict(r), "p_value": r.p_value} for r in results}}
    target_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(target_dir / AUDIT, json.dumps(report, indent=2) + "\n")
    return target_dir, report


def read_audit(eval_dir: str | Path) -> dict[str, Any] | None:
    path = Path(eval_dir) / AUDIT
    return json.loads(path.read_text()) if path.is_file() else None


def markdown_lines(decision: dict[str, Any]) -> list[str]:
    """The report's "Exactness audit" section, from decision.json."""
    audit = decision.get("audit")
    lines = ["## Exactness audit", ""]
    how = ("`trtspec audit --eval <eval dir>` compares the speculating server's first output "
           "tokens with the plain server's, and `trtspec decide` then uses it as a gate.")
    if not decision.get("audit_applies"):
        return lines + ["Not applicable: greedy requests at an endpoint are gated by greedy "
                        "identity (the sampler runs in the server). " + how]
    if audit is None:
        return lines + ["Not run: " + (how if decision.get("endpoint_eval") else
                        "`trtspec audit <eval dir>` samples the first output tokens on these "
                        "models, through the serving scheduler, and tests them against the "
                        "target's exact probabilities.")]
    if audit.get("kind") == "endpoint":
        from trtspec.audit_endpoint import markdown_lines
        return lines + markdown_lines(audit)
    s = audit["sampling"]
    tokens = audit.get("tokens", 2)  # audits before x₀ … x₃ through the scheduler tested two
    through = (f" through the serving scheduler ({audit['slots']} slots, staggered admissions)"
               if "slots" in audit else "")
    lines += [f"{audit['samples']} samples per test of the first {tokens} output tokens"
              f"{through} at D = {audit['draft_len']}, temperature {s['temperature']}, top-k "
              f"{s['top_k']}, top-p {s['top_p']}; chi-square with pooled tail against the exact "
              "joint probability; a method passes when every p-value ≥ α / tests (α = "
              f"{audit['alpha']}).", "",
              "| method | result | D | prompt | p-value | speculated | after a rejection |",
              "|---|---|---|---|---:|---:|---:|"]
    for method, m in audit["methods"].items():
        result = ("PASS" if m["passed"] else "FAIL") + (" (weak: few rejections)"
                                                         if m["weak"] else "")
        for p in m["prompts"]:
            prompt = p["prompt"].replace("|", "/")  # a table cell
            d = p.get("draft_len", audit["draft_len"])
            lines.append(f"| {method} | {result} | {d} | {prompt} | {p['p_value']:.3g} | "
                         f"{100 * p['speculated']:.0f} % | {100 * p['rejected']:.0f} % |")
    return lines
