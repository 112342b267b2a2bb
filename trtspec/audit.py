"""Exactness audit: does speculative sampling on the *actual* models emit the target's
distribution?

Terms, per prompt:

* x₀ — the first output token, sampled from the prefill; x₁ — the second, produced by the
  first verification round: an accepted draft, a token resampled from norm(max(0, p − q)) after
  a rejection, or the bonus token.
* exact P(x₀, x₁) = p(x₀ | prompt) · p(x₁ | prompt, x₀), from target prefills through the same
  ``logits_to_probs`` the executor uses.
* N seeded samples of (x₀, x₁) from the executor are tested against it: cells with expected
  count ≥ 5 are kept, the rest pooled into one tail (chi-square with pooled tail).

The default D is 1: x₁ depends only on the first draft position, and each extra position
costs a target token per sample. A method passes when every prompt's p-value ≥ α / (number of
tests) (Bonferroni), so a correct sampler fails the whole audit with probability ≤ α. The audit
is only as strong as the speculation it sees: it reports the fraction of samples whose x₁ went
through a round with drafts (``speculated``) and whose first draft was rejected (``rejected``),
and calls a method ``weak`` when fewer than ``MIN_REJECTIONS`` rejections were seen: a wrong
residual needs rejections to show.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trtspec.executor import SpecExecutor
from trtspec.files import write_atomic
from trtspec.metrics import chi_square_gof
from trtspec.sampling import SamplingParams, rows_to_probs

AUDIT = "audit.json"
MIN_REJECTIONS = 50
MIN_EXPECTED = 5.0
# Two built-in continuations (no chat template): one that invites copying, so n-gram lookup
# proposes, and one open-ended, where drafts disagree with the target more often.
PROMPTS = (
    "Colours: red, green, blue, red, green, blue, red, green, blue, red,",
    "The sky looks blue because",
)


@dataclass
class PromptAudit:
    prompt: str
    samples: int
    speculated: float  # fraction of samples whose x₁ came from a round with ≥ 1 draft
    rejected: float  # fraction of samples whose first draft was rejected (x₁ resampled)
    chi2: float
    dof: int
    p_value: float


@dataclass
class MethodAudit:
    method: str
    draft_len: int
    passed: bool
    weak: bool
    threshold: float  # the per-test p-value threshold (α / tests)
    prompts: list[PromptAudit] = field(default_factory=list)

    @property
    def p_value(self) -> float:
        return min((p.p_value for p in self.prompts), default=1.0)


def audit_prompt(executor: SpecExecutor, prompt: Sequence[int], params: SamplingParams,
                 samples: int, batch: int = 250, label: str = "",
                 progress: Callable[[int], None] | None = None) -> PromptAudit:
    """Sample (x₀, x₁) ``samples`` times through ``executor`` and test them against the exact
    joint distribution computed from its target."""
    if params.greedy:
        raise ValueError("the audit tests a distribution: use a temperature > 0")
    prompt = list(prompt)
    x0, x1, speculated, rejected = _sample(executor, prompt, params, samples, batch, progress)
    target = executor.target
    p0 = rows_to_probs(target.prefill([prompt]), [params])[0].double().cpu().numpy()  # [V]
    heads = np.flatnonzero(p0 * samples >= MIN_EXPECTED)  # x₀ worth a cell of their own
    p1 = rows_to_probs(target.prefill([prompt + [int(h)] for h in heads]),
                       [params] * len(heads)).double().cpu().numpy()  # [H, V]
    joint = p0[heads, None] * p1  # [H, V] exact P(x₀ = heads[i], x₁ = v)
    keep = joint * samples >= MIN_EXPECTED
    cell = np.full(joint.shape, -1)
    cell[keep] = np.arange(int(keep.sum()))
    row_of = {int(h): i for i, h in enumerate(heads)}
    counts = np.zeros(int(keep.sum()) + 1)  # the last cell pools every other (x₀, x₁)
    impossible = False
    for a, b in zip(x0, x1, strict=True):
        i = row_of.get(a)
        impossible |= p0[a] == 0 or (i is not None and p1[i, b] == 0)
        counts[cell[i, b] if i is not None and cell[i, b] >= 0 else -1] += 1
    probs = np.append(joint[keep], max(0.0, 1.0 - joint[keep].sum()))
    stat, dof, p = (float("inf"), 0, 0.0) if impossible else chi_square_gof(counts, probs)
    return PromptAudit(label, samples, speculated / samples, rejected / samples, stat, dof, p)


def _sample(executor: SpecExecutor, prompt: list[int], params: SamplingParams, samples: int,
            batch: int, progress: Callable[[int], None] | None
            ) -> tuple[list[int], list[int], int, int]:
    """(x₀, x₁) per sample, stopping each batch after its first round."""
    x0: list[int] = []
    x1: list[int] = []
    speculated = rejected = 0
    budget = executor.draft_len + 2  # room for a full first round: clip_draft keeps D
    for start in range(0, samples, batch):
        n = min(batch, samples - start)
        plist = [params.model_copy(update={"seed": (params.seed or 0) + start + i,
                                           "max_tokens": budget, "ignore_eos": True})
                 for i in range(n)]
        steps = executor.stream([prompt] * n, plist)
        first, second = next(steps), next(steps)
        steps.close()
        x0 += [d.token_ids[0] for d in first]
        x1 += [d.token_ids[0] for d in second]
        speculated += sum(d.num_draft > 0 for d in second)
        rejected += sum(d.num_draft > 0 and d.num_accepted == 0 for d in second)
        if progress:
            progress(n)
    return x0, x1, speculated, rejected


def audit_method(method: str, executor: SpecExecutor, prompts: Sequence[Sequence[int]],
                 labels: Sequence[str], params: SamplingParams, samples: int, alpha: float,
                 tests: int, batch: int = 250, progress: Callable[[int], None] | None = None
                 ) -> MethodAudit:
    threshold = alpha / tests
    results = [audit_prompt(executor, p, params, samples, batch, label, progress)
               for p, label in zip(prompts, labels, strict=True)]
    return MethodAudit(method, executor.draft_len,
                       passed=all(r.p_value >= threshold for r in results),
                       weak=sum(r.rejected * r.samples for r in results) < MIN_REJECTIONS,
                       threshold=threshold, prompts=results)


def audit_params(sampling: SamplingParams, temperature: float | None = None) -> SamplingParams:
    """The recipe's sampling, at temperature 1 when the recipe is greedy (greedy exactness is
    the greedy-identity gate's job; the audit needs a distribution)."""
    t = temperature if temperature is not None else (sampling.temperature or 1.0)
    return sampling.model_copy(update={"temperature": t})


def run_audit(source: str | Path, overrides: Sequence[str] = (),
              engines_root: str | Path = "engines", out: str | Path | None = None,
              prompts: Sequence[str] = (), samples: int = 1000, draft_len: int | None = None,
              temperature: float | None = None, alpha: float = 1e-3, batch: int = 250,
              progress: Callable[[int, int], None] | None = None) -> tuple[Path, dict[str, Any]]:
    """Audit every speculative method of an eval folder (the models it measured) or a recipe
    (its build); writes ``audit.json`` into the eval folder or ``out``."""
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
    d = draft_len or 1  # x₁ depends only on the first draft position: D = 1 is the cheapest
    params = audit_params(recipe.sampling.params(), temperature)
    build = OpenBuild(recipe, manifest)
    texts = list(prompts) or list(PROMPTS)
    ids = [build.encode(t, chat=False) for t in texts]
    labels = [t if len(t) <= 60 else t[:57] + "…" for t in texts]
    methods = [m.method for m in recipe.methods]
    total, done = samples * len(texts) * len(methods), 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    results = [audit_method(m, build.executor(m, d), ids, labels, params, samples,
                            alpha, len(methods) * len(texts), batch, tick) for m in methods]
    report = {"recipe": recipe.name, "alpha": alpha, "samples": samples, "draft_len": d,
              "sampling": params.model_dump(mode="json"),
              "methods": {r.method: {**asdict(r), "p_value": r.p_value} for r in results}}
    target_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(target_dir / AUDIT, json.dumps(report, indent=2) + "\n")
    return target_dir, report


def read_audit(eval_dir: str | Path) -> dict[str, Any] | None:
    path = Path(eval_dir) / AUDIT
    return json.loads(path.read_text()) if path.is_file() else None
