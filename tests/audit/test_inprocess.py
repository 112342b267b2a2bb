"""The exactness audit samples x₀ … x₃ through the scheduler (staggered admissions, rounds
after a rejection and rollback, adaptive D, a populated suffix tree), passes the real sampler
and flags deliberately broken ones: wrong verifiers and a scheduler that leaks one row's state
into another (its power)."""

from __future__ import annotations

import pytest
import torch
from broken_verifiers import accept_if_p_ge_q_verify, naive_resample_verify, wrong_past
from conftest import continuation_probs, tiny_llama

import trtspec.spec.executor
from trtspec.audit.inprocess import (
    EFFECT,
    MIN_POWER,
    PromptAudit,
    audit_lengths,
    audit_method,
    audit_params,
    audit_prompt,
    car_park,
    method_verdict,
)
from trtspec.audit.inprocess import SAMPLES as DEFAULT_SAMPLES
from trtspec.audit.sampling import MAX_BINS, draw, exact_fit
from trtspec.build.open import executor_for
from trtspec.runtime.hf import HFRunner
from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.spec.adaptive import ADAPTIVE
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose import make_proposer, method_named
from trtspec.spec.propose.draft_model import DraftModelProposer
from trtspec.spec.sample.probs import SamplingParams

PARAMS = SamplingParams(temperature=1.0, seed=7)
PROMPT = [3, 5, 7, 3, 5, 7, 3, 5]  # repetitive: n-gram lookup and suffix trees propose
SLOTS = 4
SAMPLES = 2000


def copying_target(vocab: int = 16) -> MarkovLM:
    """An order-2 Markov target that mostly goes on with the prompt's cycle 3 → 5 → 7 (the
    cycle's next token gets the row's largest logit + 1: p ≈ 0.4), else wanders, so n-gram
    drafts are often right and often rejected."""
    table = torch.randn((vocab * vocab, vocab), generator=torch.Generator().manual_seed(5))
    for a, b, c in ((3, 5, 7), (5, 7, 3), (7, 3, 5)):
        table[a * vocab + b, c] = table[a * vocab + b].max() + 1.0
    return MarkovLM(vocab, 2, table=table)


TARGET = copying_target()
DRAFT = TARGET.diverged(0.5, seed=6)


def long_prompt(length: int = 640, seed: int = 3) -> list[int]:
    """The toy's long prompt: the cycle 3 → 5 → 7 with a random token in place of one in
    five (n-gram lookup proposes, the target often leaves the cycle), ending on 3, 5."""
    g = torch.Generator().manual_seed(seed)
    cycle = [(3, 5, 7)[i % 3] for i in range(length - 2)]
    noise = torch.randint(0, 16, (len(cycle),), generator=g).tolist()
    every = torch.rand(len(cycle), generator=g).tolist()
    return [n if u < 0.2 else c for c, n, u in zip(cycle, noise, every, strict=True)] + [3, 5]


LONG = long_prompt()


def toy_executor(method: str, draft_len: int | str = 4) -> SpecExecutor:
    proposer = DraftModelProposer(ToyRunner(DRAFT)) if method == "draft_model" \
        else make_proposer(method_named(method))
    return executor_for(ToyRunner(TARGET), proposer, method, draft_len, time_models=False)


def audit(executor: SpecExecutor, samples: int = SAMPLES, prompt=PROMPT):
    return audit_prompt(executor, prompt, PARAMS, samples, SLOTS)


@pytest.mark.parametrize("method, draft_len", [("draft_model", 4), ("ngram", 4),
                                               ("suffix", 4), ("draft_model", ADAPTIVE)])
def test_audit_passes_the_real_sampler_through_the_scheduler(method: str, draft_len) -> None:
    executor = toy_executor(method, draft_len)
    result = audit(executor)
    assert result.p_value >= 1e-3, result
    assert result.dof >= 15 and result.bins <= MAX_BINS and result.draft_len == draft_len, result
    # the audit saw what it claims to test: drafts, x₃ after a rejection, staggered admission
    assert result.speculated > 0.5 and result.rejected > 0.15, result
    assert result.staggered > 0.9, result
    if method == "suffix":  # earlier requests' outputs were there to draft from
        assert executor.proposer.global_size > 0


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
@pytest.mark.parametrize("broken", [naive_resample_verify, accept_if_p_ge_q_verify])
def test_audit_flags_a_broken_verifier(method: str, broken, monkeypatch) -> None:
    monkeypatch.setattr(trtspec.spec.executor, "verify", broken)
    result = audit(toy_executor(method))
    assert result.p_value < 1e-4, result  # the audit fails below 1e-3


def _rows_swapped(real):
    """Returns a function like ``real`` whose batch rows come back rotated by one row when
    two or more rows take part: each request gets its neighbour's."""
    def leaky(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.roll(1, 0) if out.shape[0] > 1 else out
    return leaky


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_audit_flags_a_scheduler_that_leaks_target_probs_between_rows(method: str,
                                                                    monkeypatch) -> None:
    """A round verifies each row against its neighbour's p (a row-index bug): a single
    request alone would never show it; rows admitted beside each other do."""
    real = trtspec.spec.executor.rows_to_probs
    leaky = _rows_swapped(real)
    monkeypatch.setattr(trtspec.spec.executor, "rows_to_probs",
                        lambda logits, params: leaky(logits, params) if logits.dim() == 3
                        else real(logits, params))  # the first token (prefill) stays right
    result = audit(toy_executor(method))
    assert result.p_value < 1e-4, result  # the audit fails below 1e-3


def test_audit_flags_a_scheduler_that_leaks_draft_probs_between_rows(monkeypatch) -> None:
    """Each row's drafts are verified against its neighbour's q."""
    executor = toy_executor("draft_model")
    propose = executor.proposer.propose

    def leaky(*args, **kwargs):
        draft = propose(*args, **kwargs)
        draft.probs = _rows_swapped(lambda: draft.probs)()
        return draft

    monkeypatch.setattr(executor.proposer, "propose", leaky)
    result = audit(executor)
    assert result.p_value < 1e-4, result  # the audit fails below 1e-3


def test_the_audit_runs_on_a_transformer_s_kv_caches() -> None:
    """A real runner: each row's KV cache is admitted, rolled back after rejections and
    released beside the others (target and draft model)."""
    target = HFRunner(tiny_llama(vocab=32, seed=0, logit_scale=25.0))
    draft = HFRunner(tiny_llama(vocab=32, seed=1, logit_scale=25.0))
    result = audit(SpecExecutor(target, DraftModelProposer(draft), 4), samples=1000)
    assert result.p_value >= 1e-3 and result.rejected > 0.1 and result.staggered > 0.9, result


def test_the_transformers_runner_keeps_a_long_prompt_and_an_error_past_512_shows(
        monkeypatch) -> None:
    """The transformers runner (``backend.runner: transformers``, and the fallback for models
    trtspec's decoder does not run) on the long prompt, kept between samples: the real sampler
    passes, a verifier wrong only past 512 positions fails."""
    runner = HFRunner(tiny_llama(vocab=32, seed=0, logit_scale=25.0, positions=1024))
    executor = SpecExecutor(runner, make_proposer(method_named("ngram")), 4)
    real = audit_prompt(executor, LONG, PARAMS, 600, SLOTS)
    assert real.p_value >= 1e-3 and real.kept_prompt and real.positions > 600, real
    monkeypatch.setattr(trtspec.spec.executor, "verify", wrong_past(512, accept_if_p_ge_q_verify))
    broken = audit_prompt(executor, LONG, PARAMS, 600, SLOTS)
    assert broken.p_value < 1e-3, broken  # the audit's level with one method


def test_exact_fit_against_sequences_drawn_from_the_enumerated_distribution() -> None:
    """Without the sampler: sequences drawn from the target's enumerated P(x₀ … x₃) pass,
    sequences from the draft's fail, and a token top-k filters out is impossible (p = 0)."""
    import numpy as np

    params = SamplingParams(temperature=1.0, top_k=3)
    rng = np.random.default_rng(0)

    def drawn_from(model: MarkovLM, n: int) -> list[tuple[int, ...]]:
        exact = continuation_probs(model, PROMPT, 4, params)
        seqs, probs = list(exact), np.array(list(exact.values()))
        return [seqs[i] for i in rng.choice(len(seqs), n, p=probs / probs.sum())]

    runner = ToyRunner(TARGET)
    right = exact_fit(runner, PROMPT, params, drawn_from(TARGET, 2000), rows=SLOTS)
    assert right.p_value >= 1e-3 and right.dof >= 15 and right.impossible == 0, right
    wrong = exact_fit(runner, PROMPT, params, drawn_from(DRAFT, 2000), rows=SLOTS)
    assert wrong.p_value < 1e-6, wrong
    worst = int(TARGET.next_logits(PROMPT).argmin())  # never among the top 3
    bad = exact_fit(runner, PROMPT, params, [(worst, 3, 5, 7)] + drawn_from(TARGET, 99),
                    rows=SLOTS)
    assert bad.p_value == 0.0 and bad.impossible == 1


def test_draws_are_seeded() -> None:
    a = draw(toy_executor("ngram"), PROMPT, PARAMS, 60, SLOTS)
    b = draw(toy_executor("ngram"), PROMPT, PARAMS, 60, SLOTS)
    assert a.sequences == b.sequences and len(set(a.sequences)) > 10


def test_method_verdict_sums_the_tests_and_states_its_power() -> None:
    """By hand: tests with χ² 10 (5 dof) and 20 (8 dof) and noncentralities 3 and 4 make one
    test of χ² 30 on 13 dof at α / methods; its power is P(χ²₁₃(λ = 7) > the critical
    value)."""
    from scipy.stats import chi2, ncx2

    def test(stat: float, dof: int, lam: float, recovered: float) -> PromptAudit:
        return PromptAudit("p", 4, 1000, 0.9, recovered, 0.3, 1.0, stat, dof,
                           float(chi2.sf(stat, dof)), dof + 1, 4.0, lam, 40, False, 1.0)

    m = method_verdict("ngram", [4], [test(10, 5, 3.0, 0.5), test(20, 8, 4.0, 0.02)],
                       alpha=1e-3, methods=2)
    assert m.chi2 == 30 and m.dof == 13 and m.threshold == pytest.approx(5e-4)
    assert m.p_value == pytest.approx(chi2.sf(30, 13)) and m.passed
    assert m.power == pytest.approx(ncx2.sf(chi2.isf(5e-4, 13), 13, 7.0))
    assert m.power < MIN_POWER and m.weak and m.recovered_samples == 520
    strong = method_verdict("ngram", [4], [test(10, 5, 60.0, 0.5)], alpha=1e-3, methods=1)
    assert strong.power > 0.99 and not strong.weak
    few = method_verdict("ngram", [4], [test(10, 5, 60.0, 0.04)], alpha=1e-3, methods=1)
    assert few.weak and few.recovered_samples == 40  # < MIN_REJECTIONS, whatever the power
    impossible = method_verdict("ngram", [4], [test(float("inf"), 0, 0.0, 0.5),
                                               test(1, 3, 60.0, 0.5)], alpha=1e-3, methods=1)
    assert impossible.p_value == 0.0 and not impossible.passed


def test_each_test_of_a_method_draws_its_own_seeds(monkeypatch) -> None:
    """Tests that shared seeds would share x₀ (and much of x₁ … x₃): their chi-squares would
    not add up to a chi-square of the summed dof."""
    import trtspec.audit.inprocess

    seen: list[tuple[int, list]] = []
    real = trtspec.audit.inprocess.draw

    def recording(executor, prompt, params, *args, **kwargs):
        drawn = real(executor, prompt, params, *args, **kwargs)
        seen.append((params.seed, drawn.sequences))
        return drawn

    monkeypatch.setattr(trtspec.audit.inprocess, "draw", recording)
    audit_method("ngram", lambda d: toy_executor("ngram", d), [4, ADAPTIVE], [PROMPT, PROMPT],
                 ["a", "b"], PARAMS, 200, SLOTS, alpha=1e-3, methods=1)
    seeds = [seed for seed, _ in seen]
    assert len(set(seeds)) == 4 and min(abs(a - b) for a in seeds for b in seeds if a != b) \
        > 10 * 200
    same = sum(a[0] == b[0] for a, b in zip(seen[0][1], seen[2][1], strict=True))
    assert same < 0.8 * 200, same  # x₀ of the same prompt at the other D: other draws


def test_noncentrality_is_n_times_the_recovered_share_of_the_effect_squared_times_l() -> None:
    result = audit(toy_executor("draft_model"), samples=400)
    assert result.noncentrality == pytest.approx(
        400 * (result.recovered * EFFECT) ** 2 * result.least_favourable)
    assert 4.0 <= result.least_favourable < 4.5 and not result.kept_prompt  # bins near ½


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_a_verifier_wrong_only_past_position_512_fails_the_audit_at_its_defaults(
        method: str, monkeypatch) -> None:
    """The power check the long prompt is for: a residual that is wrong only once the rows
    hold more than 512 positions. At the default sample count on a long prompt (as the
    built-in one) the real sampler passes with power ≥ 0.8 against the default effect; the
    broken one passes on a short prompt (it is right there) and fails on the long one."""
    def run(prompts):
        return audit_method(method, lambda d: toy_executor(method, d), [4], prompts,
                            ["p"] * len(prompts), PARAMS, DEFAULT_SAMPLES, SLOTS, alpha=1e-3,
                            methods=1)

    real = run([LONG])
    assert real.passed, real
    if method == "ngram":  # most samples see a rejection (the draft model's are rarer)
        assert not real.weak and real.power >= MIN_POWER, real
    assert real.prompts[0].kept_prompt and real.prompts[0].positions == len(LONG) > 600
    monkeypatch.setattr(trtspec.spec.executor, "verify", wrong_past(512, naive_resample_verify))
    short = run([PROMPT])
    assert short.passed and not short.prompts[0].kept_prompt, short  # right below 512
    broken = run([LONG])
    assert not broken.passed and broken.p_value < broken.threshold, broken


def test_the_built_in_long_prompt_is_long_in_any_tokenizer() -> None:
    chars = car_park(lambda text: list(text), positions=700)  # one token per character
    assert len(chars) >= 700 and chars == car_park(lambda text: list(text), positions=700)
    words = car_park(lambda text: text.split(), positions=600)
    assert len(words.split()) >= 600 and words.startswith("Cars in the car park")


def test_audit_needs_a_distribution_and_audits_the_eval_s_lengths() -> None:
    with pytest.raises(ValueError, match="temperature > 0"):
        audit_prompt(toy_executor("ngram"), PROMPT, SamplingParams(temperature=0), 10, SLOTS)
    assert audit_params(SamplingParams(temperature=0, top_k=5)).temperature == 1.0
    assert audit_params(SamplingParams(temperature=0.7)).temperature == 0.7
    assert audit_lengths([2, 4]) == [4]
    assert audit_lengths([2, ADAPTIVE, 8, 4]) == [8, ADAPTIVE]
    assert audit_lengths([ADAPTIVE]) == [ADAPTIVE]


def test_audit_on_smollm2_flags_an_error_past_512(smollm2, monkeypatch) -> None:
    """The actual model on the runner users get (trtspec's decoder; eager here, as every test
    but the compiled ones) through the scheduler: n-gram lookup at D = 4 on the built-in long
    prompt (its KV cache kept between samples) with a verifier that accepts when p ≥ q only
    once the rows hold more than 512 positions (the subtler resampling error needs the default
    sample count there: the toy test above). The real sampler passes the same audit on this
    model in tests/eval/test_evaluate.py (through `trtspec audit`, 300 samples of this prompt)
    and tests/test_tour.py; the transformers runner's caches on a long prompt are audited in
    test_the_transformers_runner_keeps_a_long_prompt_and_an_error_past_512_shows."""
    from trtspec.runtime.compiled import CompiledRunner
    from trtspec.runtime.models import encode

    ids = encode(smollm2.tokenizer, car_park(lambda t: encode(smollm2.tokenizer, t,
                                                                chat=False)), chat=False)
    runner = CompiledRunner(smollm2.model, eos_token_id=smollm2.tokenizer.eos_token_id,
                            compile=False, capacity=1024)
    executor = SpecExecutor(runner, make_proposer(method_named("ngram")), 4)
    monkeypatch.setattr(trtspec.spec.executor, "verify", wrong_past(512, accept_if_p_ge_q_verify))
    broken = audit_prompt(executor, ids, PARAMS, 100, SLOTS)  # measured p ≈ 1e-46 (0.37 at 30)
    assert broken.kept_prompt and broken.positions >= 600 and broken.staggered > 0.9, broken
    assert broken.p_value < 1e-6, broken


TINY_RECIPE = """\
name: tiny
target: {{model: {model}, dtype: float32}}
methods: [{{method: ngram}}, {{method: layer_skip, layers: 1}}]
draft_lengths: [2, 3, adaptive]
limits: {{max_batch_size: 3}}
backend: {{kind: torch, device: cpu}}
"""


def test_trtspec_audit_writes_what_decide_reads_and_says_its_progress(
        tmp_path, smollm2, capsys, monkeypatch) -> None:
    """The command at its defaults on a tiny build: every method at the eval's largest fixed
    D and adaptive, on both built-in prompts (the long one ≥ 600 tokens), through the build's
    own runner and slots; plain progress lines off a terminal."""
    import json

    from transformers import AutoTokenizer

    import trtspec.build.gpu
    from trtspec.cli import main
    from trtspec.runtime.models import resolve

    monkeypatch.setattr(trtspec.build.gpu, "detect", lambda: [])  # a CPU machine, whatever runs it
    model = tmp_path / "tiny-llama"
    tiny_llama(vocab=smollm2.model.config.vocab_size, logit_scale=25.0,
               positions=1024).save_pretrained(model)
    AutoTokenizer.from_pretrained(resolve("smollm2-135m-instruct")).save_pretrained(model)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE.format(model=model))
    engines = ["--engines", str(tmp_path / "engines")]
    main(["build", str(recipe), *engines])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["audit", str(recipe), *engines, "--out", str(tmp_path / "a")])
    out, err = capsys.readouterr()
    report = json.loads((tmp_path / "a" / "audit.json").read_text())
    # a random tiny model leaves n-gram lookup little to copy: too few rejections to have
    # power, so the PASS is weak and the command exits 1 (a CI gate: no GO can rest on it)
    weak = any(m["weak"] for m in report["methods"].values())
    assert exit_info.value.code == (1 if weak else 0), out + err
    assert report["draft_lengths"] == [3, ADAPTIVE] and report["slots"] == 3
    for method in ("ngram", "layer_skip"):
        m = report["methods"][method]
        assert m["passed"] and m["p_value"] >= m["threshold"] == pytest.approx(1e-3 / 2)
        assert isinstance(m["weak"], bool) and 0 <= m["power"] <= 1 and m["effect"] == EFFECT
        assert [(p["draft_len"], p["samples"]) for p in m["prompts"]] == [
            (3, DEFAULT_SAMPLES), (ADAPTIVE, DEFAULT_SAMPLES)]
        assert all(p["positions"] >= 600 and p["kept_prompt"] for p in m["prompts"])
        assert f"audit {method}: {2 * DEFAULT_SAMPLES} samples to draw" in err
        assert f"audit {method}: {2 * DEFAULT_SAMPLES}/{2 * DEFAULT_SAMPLES} samples in" in err
    assert "PASS" in out and "staggered" in out and "power" in out
    assert report["methods"]["ngram"]["weak"] and "PASS (weak)" in out


def test_progress_off_a_terminal_is_a_line_every_few_seconds_with_the_time_left() -> None:
    from trtspec.cli.measure import AuditTicker, audit

    samples = next(p for p in audit.params if p.name == "samples")  # None: by the mode
    assert samples.default is None and f"[default: {DEFAULT_SAMPLES};" in samples.help

    lines: list[str] = []
    now = [0.0]
    ticker = AuditTicker(None, tty=False, every=10.0, echo=lines.append, clock=lambda: now[0])
    ticker("ngram", 0, 300)
    for done in range(1, 301):
        now[0] += 0.25  # 4 samples a second
        ticker("ngram", done, 300)
    ticker("layer_skip", 0, 300)
    assert lines[0] == "audit ngram: 300 samples to draw"
    assert lines[1] == "audit ngram: 40/300 samples, about 1m05s left"  # every 10 s
    assert lines[-2] == "audit ngram: 300/300 samples in 1m15s"
    assert lines[-1] == "audit layer_skip: 300 samples to draw" and len(lines) == 10


def test_progress_on_a_terminal_is_a_bar_per_method() -> None:
    import io

    from rich.console import Console
    from rich.progress import Progress

    from trtspec.cli.measure import AuditTicker

    screen = io.StringIO()
    with Progress(console=Console(file=screen, force_terminal=True, width=100)) as bar:
        ticker = AuditTicker(bar, tty=True)
        ticker.say("audit: opening the models")
        for method in ("ngram", "layer_skip"):
            ticker(method, 0, 10)
            ticker(method, 10, 10)
        assert [t.description for t in bar.tasks] == ["audit ngram", "audit layer_skip"]
        assert all(t.completed == t.total == 10 for t in bar.tasks)
    assert "audit: opening the models" in screen.getvalue()
