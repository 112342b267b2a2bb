"""Medusa heads on the torch backend: sampling exactness (with a power check), greedy identity,
the hidden state each row drafts from, continuous batching, and the checkpoint layout."""

from __future__ import annotations

import json
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from broken_verifiers import naive_resample_verify
from conftest import tiny_llama
from exactness import exact_two_token_probs
from safetensors.torch import save_file

import trtspec.spec.executor
from trtspec.analysis.gof import chi_square_gof
from trtspec.runtime.compiled import CompiledRunner
from trtspec.runtime.hf import HFRunner
from trtspec.serve.scheduler import Scheduler
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.heads import HeadsError
from trtspec.spec.propose.heads.medusa import MedusaHeads, MedusaProposer, load_medusa, save_medusa
from trtspec.spec.sample.probs import SamplingParams

PROMPT = [3, 1, 4, 1, 5]
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.7, top_k=12, top_p=0.9)]


def noisy_heads(model, num_heads: int = 3, num_layers: int = 1, seed: int = 0,
                scale: float = 0.3) -> MedusaHeads:
    """Medusa's initialisation plus seeded noise: q differs from p but overlaps it."""
    heads = MedusaHeads.from_target(model, num_heads, num_layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, head in enumerate(heads.heads):
            for j in range(num_layers):
                for p in head[j].linear.parameters():  # zero at Medusa's init
                    p.add_(torch.randn(p.shape, generator=g) * scale)
            w = heads.projection(k).weight
            w.add_(torch.randn(w.shape, generator=g) * scale * w.std())
    return heads


def make_runner(model, compiled: bool):
    return CompiledRunner(model, compile=False) if compiled else HFRunner(model)


def two_token_pvalue(params: SamplingParams, trials: int, compiled: bool = False
                     ) -> tuple[float, int]:
    """(chi-square p-value of the first two tokens, drafts accepted)."""
    model = tiny_llama(vocab=32, layers=2, seed=1, logit_scale=6.0)
    runner = make_runner(model, compiled)
    executor = SpecExecutor(runner, MedusaProposer(runner, noisy_heads(model)), 3,
                            clip_draft=False)
    reqs = [params.model_copy(update={"seed": i, "max_tokens": 2}) for i in range(trials)]
    outs = executor.generate([PROMPT] * trials, reqs)
    vocab = model.config.vocab_size
    counts = Counter(c.token_ids[0] * vocab + c.token_ids[1] for c in outs)
    exact = exact_two_token_probs(model, PROMPT, params).flatten()
    pvalue = chi_square_gof([counts.get(i, 0) for i in range(vocab * vocab)], exact.tolist())[2]
    return pvalue, sum(c.stats.accepted_draft_tokens for c in outs)


@pytest.mark.parametrize(("params", "compiled"),
                         [(SAMPLINGS[0], False), (SAMPLINGS[1], False), (SAMPLINGS[0], True)],
                         ids=["t1-hf", "t0.7_topk12_topp0.9-hf", "t1-compiled"])
def test_medusa_sampling_is_exact(params: SamplingParams, compiled: bool) -> None:
    """The first two tokens' joint law against exact probabilities, D = 3 from noisy heads
    (the compiled runner's sampling code is the same: one sampling there covers its capture)."""
    pvalue, accepted = two_token_pvalue(params, 30_000, compiled)
    assert pvalue > 1e-3 and accepted > 1000  # ~1 (t1) and ~0.27 (t0.7) drafts per request


def test_power_broken_verifier_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same harness with a verifier that resamples from p on rejection (wrong): p-values
    ~1e-120 at 10k trials, so 10k suffice."""
    monkeypatch.setattr(trtspec.spec.executor, "verify", naive_resample_verify)
    assert two_token_pvalue(SamplingParams(), 10_000)[0] < 1e-3


def normed_last_state(model, seq: list[int]) -> torch.Tensor:
    """The target's last hidden state (after the final norm) at the end of ``seq``, from a full
    forward without a cache: what the logits that followed ``seq`` came from."""
    with torch.inference_mode():
        return model(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0, -1]


@pytest.mark.parametrize("compiled", [False, True], ids=["hf", "compiled"])
def test_each_row_drafts_from_the_position_that_gave_its_last_token(compiled: bool) -> None:
    """After prefill and after every round, h[b] is the target's normed last hidden state at
    the position whose logits gave row b's last token (full forward, no cache)."""
    model = tiny_llama(vocab=32, layers=2, seed=1, logit_scale=6.0)
    runner = make_runner(model, compiled)
    proposer = MedusaProposer(runner, noisy_heads(model))
    executor = SpecExecutor(runner, proposer, 3)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10]]
    params = [SamplingParams(seed=b, max_tokens=12) for b in range(3)]
    reqs = executor._requests(prompts, params)
    checked = 0
    for _ in executor._run(reqs):
        for b, r in enumerate(reqs):
            if r.finish_reason is not None:
                continue
            seq = r.prompt + r.output[:-1]  # the last token came from the logits at seq[-1]
            want = normed_last_state(model, seq)
            assert torch.allclose(proposer._h[b], want, atol=1e-5), (b, len(r.output))
            checked += 1
    assert checked > 10
    assert sum(r.stats.accepted_draft_tokens for r in reqs) > 0


@pytest.mark.parametrize("compiled", [False, True], ids=["hf", "compiled"])
def test_greedy_medusa_equals_plain_greedy(compiled: bool) -> None:
    model = tiny_llama(vocab=48, layers=3, seed=5, logit_scale=20.0)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 7, 8], [3, 3, 3]]
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = SpecExecutor(make_runner(model, compiled)).generate(prompts, params)
    runner = make_runner(model, compiled)
    proposer = MedusaProposer(runner, MedusaHeads.from_target(model, 4))
    assert proposer.draft_runner is None and "4 heads" in proposer.describe()
    out = SpecExecutor(runner, proposer, 3).generate(prompts, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    assert sum(c.stats.accepted_draft_tokens for c in out) > 0


def test_continuous_batching_greedy_equals_plain() -> None:
    """More requests than slots: admitted, finished (some before any round) and released rows
    keep every other row's hidden state; greedy output equals plain decoding."""
    model = tiny_llama(vocab=48, layers=3, seed=5, logit_scale=20.0)
    target = HFRunner(model)
    proposer = MedusaProposer(target, noisy_heads(model, num_heads=4, scale=0.05))
    scheduler = Scheduler(SpecExecutor(target, proposer, 3), slots=2)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (1, 2, 1, 9, 12, 15)]
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 7, 8], [3, 3, 3], [2, 7]]
    tickets = [scheduler.submit(p, s) for p, s in zip(prompts, params, strict=True)]
    scheduler.run_until_idle()
    plain = SpecExecutor(HFRunner(model))
    for ticket, prompt, p in zip(tickets, prompts, params, strict=True):
        assert ticket.token_ids == plain.generate([prompt], p)[0].token_ids
    assert sum(t.stats.proposed_tokens for t in tickets) > 0


@pytest.mark.parametrize("compiled, keep", [(False, False), (True, False), (True, True)],
                         ids=["hf", "compiled", "kept-prompts"])
def test_scheduler_rows_draft_from_the_position_that_gave_their_last_token(compiled: bool,
                                                                          keep: bool) -> None:
    """More requests than slots, sampled: admissions into a running batch, releases, rows
    ending at different times. After every step, each running row's h is the target's normed
    last hidden state where its last token came from (full forward, no cache). With kept
    prompts the prompts repeat: a slot that kept one admits it again from its last token."""
    model = tiny_llama(vocab=32, layers=2, seed=1, logit_scale=6.0)
    runner = make_runner(model, compiled)
    proposer = MedusaProposer(runner, noisy_heads(model))
    scheduler = Scheduler(SpecExecutor(runner, proposer, 3), slots=3, keep_prompts=keep)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [7, 7], [*range(20, 32)], [3, 1, 4, 1, 5],
               [9]]
    budgets = (8, 1, 12, 3, 10, 6, 9)
    if keep:
        prompts, budgets = [[5, 6, 7, 8, 9, 10]] * 7, (8, 10, 6, 12, 9, 5, 11)
    tickets = [scheduler.submit(p, SamplingParams(seed=i, max_tokens=n))
               for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))]
    checked = 0
    while scheduler.step() or scheduler.waiting:
        for slot, ticket in enumerate(scheduler._tickets):
            if ticket is None or ticket.finish_reason is not None:
                continue
            want = normed_last_state(model, ticket.prompt + ticket.token_ids[:-1])
            assert torch.allclose(proposer._h[slot], want, atol=1e-5), (slot, ticket.prompt)
            checked += 1
    assert [t.finish_reason for t in tickets] == ["length"] * len(tickets)
    assert checked > 15 and sum(t.stats.accepted_draft_tokens for t in tickets) > 0


def test_a_target_without_llama_layers_is_refused_in_one_line() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=64, n_embd=32, n_layer=2,
                                      n_head=4))
    runner = SimpleNamespace(model=gpt2, vocab_size=32, capture_hidden=lambda layers: None)
    want = "medusa heads need a Llama-family target (decoder layers + final norm): gpt2"
    with pytest.raises(HeadsError, match=re.escape(want)):
        MedusaProposer(runner, MedusaHeads.from_target(gpt2, 2))


# --- checkpoints -----------------------------------------------------------------------------

def public_tensors(heads: MedusaHeads, prefix: str = "") -> dict[str, torch.Tensor]:
    """The public layout, written by hand: {k}.{j}.linear.weight/bias, {k}.{L}.weight."""
    out = {}
    for k in range(heads.num_heads):
        for j in range(heads.num_layers):
            out[f"{prefix}{k}.{j}.linear.weight"] = heads.heads[k][j].linear.weight
            out[f"{prefix}{k}.{j}.linear.bias"] = heads.heads[k][j].linear.bias
        out[f"{prefix}{k}.{heads.num_layers}.weight"] = heads.projection(k).weight
    return {k: v.detach().clone() for k, v in out.items()}


def write_public(folder, tensors, pt: bool = False, **config) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    base = {"medusa_num_heads": 3, "medusa_num_layers": 2, "hidden_size": 32, "vocab_size": 32,
            "base_model_name_or_path": "tiny"}
    (folder / "config.json").write_text(json.dumps({**base, **config}))
    if pt:
        torch.save(tensors, folder / "medusa_lm_head.pt")
    else:
        save_file(tensors, str(folder / "medusa_lm_head.safetensors"))


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=32, layers=2, seed=1, logit_scale=6.0)


def sample_outputs(model, heads: MedusaHeads) -> list[list[int]]:
    runner = HFRunner(model)
    executor = SpecExecutor(runner, MedusaProposer(runner, heads), 3)
    params = [SamplingParams(seed=s, max_tokens=10) for s in range(6)]
    return [c.token_ids for c in executor.generate([[1, 2, 3]] * 6, params)]


def test_save_then_load_drafts_identically(target, tmp_path) -> None:
    heads = noisy_heads(target, num_layers=2)
    save_medusa(heads, tmp_path / "m", "tiny")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config == {"medusa_num_heads": 3, "medusa_num_layers": 2, "hidden_size": 32,
                      "vocab_size": 32, "base_model_name_or_path": "tiny"}
    loaded = load_medusa(tmp_path / "m", target)
    h = torch.randn(5, 32)
    with torch.no_grad():
        assert torch.equal(loaded(h), heads(h))
    assert sample_outputs(target, loaded) == sample_outputs(target, heads)
    assert load_medusa(tmp_path / "m", target, num_heads=2).num_heads == 2
    with pytest.raises(HeadsError, match="4 heads asked, the checkpoint has 3"):
        load_medusa(tmp_path / "m", target, num_heads=4)


@pytest.mark.parametrize("pt", [False, True], ids=["safetensors", "pt"])
@pytest.mark.parametrize("prefix", ["", "medusa_head."], ids=["bare", "prefixed"])
def test_the_public_layout_written_by_hand_loads(target, tmp_path, pt: bool, prefix: str
                                                  ) -> None:
    heads = noisy_heads(target, num_layers=2, seed=3)
    write_public(tmp_path, public_tensors(heads, prefix), pt=pt)
    loaded = load_medusa(tmp_path, target)
    h = torch.randn(4, 32)
    with torch.no_grad():
        assert torch.equal(loaded(h), heads(h))


def one_line_error(folder, target) -> str:
    with pytest.raises(HeadsError) as e:
        load_medusa(folder, target)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_missing_or_misshaped_tensor_is_named(target, tmp_path) -> None:
    tensors = public_tensors(noisy_heads(target, num_layers=2))
    missing = dict(tensors)
    del missing["1.0.linear.bias"]
    write_public(tmp_path / "a", missing)
    assert "tensor 1.0.linear.bias is missing" in one_line_error(tmp_path / "a", target)
    bad = {**tensors, "2.2.weight": torch.zeros(32, 33)}
    write_public(tmp_path / "b", {"medusa_head." + k: v for k, v in bad.items()}, pt=True)
    message = one_line_error(tmp_path / "b", target)
    assert "medusa_head.2.2.weight" in message and "[32, 33]" in message


def test_folder_config_and_sizes_are_checked(target, tmp_path) -> None:
    assert "no such heads directory" in one_line_error(tmp_path / "nowhere", target)
    (tmp_path / "empty").mkdir()
    assert "config.json: missing" in one_line_error(tmp_path / "empty", target)
    tensors = public_tensors(noisy_heads(target, num_layers=2))
    write_public(tmp_path / "h", tensors, hidden_size=64)
    message = one_line_error(tmp_path / "h", target)
    assert "hidden_size 64" in message and "32" in message
    write_public(tmp_path / "v", tensors, vocab_size=50)
    assert "vocab_size 50" in one_line_error(tmp_path / "v", target)
    write_public(tmp_path / "n", {})
    assert "tensor 0.0.linear.weight is missing" in one_line_error(tmp_path / "n", target)


@pytest.mark.parametrize("key,value", [
    ("medusa_num_heads", None), ("medusa_num_heads", "3"), ("medusa_num_heads", 0),
    ("medusa_num_heads", -2), ("medusa_num_heads", 2.0), ("medusa_num_heads", True),
    ("medusa_num_layers", None), ("medusa_num_layers", "2"), ("medusa_num_layers", -1),
    ("medusa_num_layers", 1.5),
])
def test_a_mistyped_head_count_is_named(target, tmp_path, key: str, value) -> None:
    write_public(tmp_path, public_tensors(noisy_heads(target, num_layers=2)), **{key: value})
    least = 1 if key == "medusa_num_heads" else 0
    message = one_line_error(tmp_path, target)
    assert message == f"{tmp_path / 'config.json'}: {key} must be an integer ≥ {least}, got " \
        f"{value!r}"


def test_a_head_without_its_projection_shares_the_target_s_lm_head(target, tmp_path) -> None:
    heads = noisy_heads(target, num_layers=2)
    tensors = {k: v for k, v in public_tensors(heads).items() if k != "1.2.weight"}
    write_public(tmp_path / "no", tensors)
    assert "tensor 1.2.weight is missing" in one_line_error(tmp_path / "no", target)
    write_public(tmp_path / "s", tensors, medusa_shared_lm_head=True)
    loaded = load_medusa(tmp_path / "s", target)
    assert loaded.shared == [False, True, False]
    assert loaded.projection(1) is target.get_output_embeddings()  # shared, not copied
    assert not any(p is target.lm_head.weight for p in loaded.parameters())
    # saved for TensorRT-LLM (a copy of the target's head), or kept shared (trtspec only)
    save_medusa(loaded, tmp_path / "full", "tiny")
    full = load_medusa(tmp_path / "full", target)
    save_medusa(loaded, tmp_path / "kept", "tiny", keep_shared=True)
    kept = load_medusa(tmp_path / "kept", target)
    assert full.shared == [False] * 3 and kept.shared == [False, True, False]
    h = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.equal(full(h), loaded(h)) and torch.equal(kept(h), loaded(h))
