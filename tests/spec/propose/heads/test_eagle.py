"""EAGLE-3 heads: exact sampling through both torch runners (with a power check), the draft
cache against the uncached whole-sequence forward, greedy identity (executor and scheduler),
and reading / writing the public checkpoint layout."""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from broken_verifiers import naive_resample_verify
from conftest import count_fed, tiny_llama
from exactness import exact_two_token_probs

import trtspec.spec.executor
import trtspec.spec.propose.heads.eagle
from trtspec.analysis.gof import chi_square_gof
from trtspec.runtime.compiled import CompiledRunner
from trtspec.runtime.hf import HFRunner
from trtspec.serve.scheduler import Scheduler
from trtspec.serve.slots import DraftPolicy
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.heads import HeadsError
from trtspec.spec.propose.heads.eagle import (
    Eagle3Config,
    Eagle3Draft,
    EagleProposer,
    default_aux_layers,
    groups,
    load_eagle3,
    save_eagle3,
)
from trtspec.spec.sample.probs import SamplingParams, rows_to_probs

PROMPT = [3, 1, 4, 1, 5]
AUX = [1, 3, 4]  # distinct layers of the 6-layer target (the default would be [1, 2, 2])
KEEP = torch.tensor([i for i in range(32) if i % 4 != 1])  # 24 of 32 ids: d2t is not trivial
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.7, top_k=12, top_p=0.9)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: a second BLAS thread only waits on the shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def target_model():
    return tiny_llama(vocab=32, layers=6, seed=1, logit_scale=6.0)


def random_draft(target, seed: int = 7, own_embeddings: bool = False) -> Eagle3Draft:
    """A seeded head with a 24-id vocabulary: from_target's init plus noise of half each
    weight's spread, so q differs from p but overlaps it (about half the drafts accepted)."""
    base = Eagle3Draft.from_target(target, AUX, KEEP)
    draft = Eagle3Draft(base.config, own_embeddings=own_embeddings)
    draft.load_state_dict(base.state_dict(), strict=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if draft.embed_tokens is not None:
            draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        for p in draft.parameters():
            spread = p.std() if p.dim() > 1 else 0.1
            p.add_(0.5 * spread * torch.randn(p.shape, generator=gen))
    return draft.eval()


def make_runner(kind: str, model):
    return HFRunner(model) if kind == "hf" else CompiledRunner(model, compile=False)


def two_token_pvalue(kind: str, params: SamplingParams, trials: int = 30_000,
                     chunk: int = 7_500) -> tuple[float, int]:
    """p-value of the joint first two tokens against the exact law, and drafts accepted."""
    target = target_model()
    draft = random_draft(target)
    counts: Counter[int] = Counter()
    accepted = 0
    for start in range(0, trials, chunk):  # chunks bound the runners' KV caches
        runner = make_runner(kind, target)
        executor = SpecExecutor(runner, EagleProposer(runner, draft), 3, clip_draft=False)
        reqs = [params.model_copy(update={"seed": i, "max_tokens": 2})
                for i in range(start, min(trials, start + chunk))]
        for c in executor.generate([PROMPT] * len(reqs), reqs):
            counts[c.token_ids[0] * 32 + c.token_ids[1]] += 1
            accepted += c.stats.accepted_draft_tokens
    exact = exact_two_token_probs(target, PROMPT, params).flatten()
    return chi_square_gof([counts.get(i, 0) for i in range(32 * 32)], exact.tolist())[2], accepted


@pytest.mark.parametrize("params", SAMPLINGS, ids=["t1", "t0.7_topk12_topp0.9"])
def test_sampling_is_exact_on_the_transformers_runner(params: SamplingParams) -> None:
    p, accepted = two_token_pvalue("hf", params)
    print(f"hf {params.shape_key}: p = {p:.3g}, {accepted} drafts accepted in 30000 rounds")
    assert p > 1e-3
    assert accepted > 10_000  # the drafts took part


def test_sampling_is_exact_on_the_compiled_runner() -> None:
    p, accepted = two_token_pvalue("compiled", SAMPLINGS[1])
    print(f"compiled: p = {p:.3g}, {accepted} drafts accepted in 30000 rounds")
    assert p > 1e-3
    assert accepted > 10_000


def test_power_a_broken_verifier_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trtspec.spec.executor, "verify", naive_resample_verify)
    p = two_token_pvalue("hf", SAMPLINGS[0])[0]
    print(f"naive resampling: p = {p:.3g}")
    assert p < 1e-3


class Recording(EagleProposer):
    """Keeps every proposal with the tokens it continued."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rounds: list = []

    def propose(self, tokens, draft_len, params, generators):
        draft = super().propose(tokens, draft_len, params, generators)
        self.rounds.append(([list(t) for t in tokens], draft, list(params)))
        return draft


@torch.inference_mode()
def reference_probs(target, draft: Eagle3Draft, tokens: list[int], ids: list[int],
                    params: SamplingParams) -> list[torch.Tensor]:
    """q of each draft from scratch: the target's states from one forward over the committed
    tokens, then the head's uncached whole-sequence forward, once per draft (the chain's g and
    draft ids appended)."""
    states = target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[layer + 1][0] for layer in AUX], dim=-1)  # [n−1, 3H] (pre-norm)
    hidden = draft.fuse(aux)  # pairs 0 … n−2
    embeds = target.get_input_embeddings()(torch.tensor(tokens[1:]))
    out = []
    for x in ids:
        positions = torch.arange(len(hidden))[None]
        g, logits = draft(embeds[None], hidden[None], positions)
        out.append(rows_to_probs(draft.target_logits(logits[:, -1]), [params])[0])
        hidden = torch.cat([hidden, g[0, -1:]])
        embeds = torch.cat([embeds, target.get_input_embeddings()(torch.tensor([x]))])
    return out


def check_rounds(target, draft: Eagle3Draft, rounds: list) -> int:
    """Every recorded proposal's q against the head run from scratch over the tokens it
    continued (:func:`reference_probs`). Returns the drafts checked."""
    checked = 0
    for tokens, out, row_params in rounds:
        for b, row in enumerate(tokens):
            n = int(out.num_draft[b])
            if n == 0:
                continue
            ids = out.token_ids[b, :n].tolist()
            for i, q in enumerate(reference_probs(target, draft, row, ids, row_params[b])):
                assert torch.allclose(out.probs[b, i], q, atol=1e-5), (b, len(row), i)
                assert out.probs[b, i, q.new_ones(32).bool().index_fill(0, KEEP, False)].eq(
                    0).all()  # nothing off the head's vocabulary
                checked += 1
    return checked


@pytest.mark.parametrize("kind", ["hf", "compiled"])
def test_cached_drafting_equals_the_uncached_forward_over_many_rounds(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of other lengths, drafts accepted and rejected, rounds that draft nothing (the
    target's states pile up as pending), a row drafting alone (then rows of far apart pending
    counts, fed in separate calls), the budget's clipped last rounds: every round's q equals
    the head run from scratch over the committed tokens."""
    split: list[list[list[int]]] = []
    plain = trtspec.spec.propose.heads.eagle.groups

    def groups(counts, slack):
        out = plain(counts, slack)
        split.extend([out] if len(out) > 1 else [])
        return out

    monkeypatch.setattr(trtspec.spec.propose.heads.eagle, "groups", groups)
    target = target_model()
    draft = random_draft(target)
    runner = make_runner(kind, target)
    proposer = Recording(runner, draft)
    executor = SpecExecutor(runner, proposer, 3)
    params = SamplingParams(temperature=0.8, max_tokens=32)
    prompts = [PROMPT, [7, 2], [9, 9, 8, 1, 6, 0, 2, 5], [4]]
    reqs = [executor.request(p, params.model_copy(update={"seed": i}))
            for i, p in enumerate(prompts)]
    executor.first_tokens(reqs, [0, 1, 2, 3], runner.prefill(prompts))
    proposer.start(prompts)
    for d in [3, 0, 2, *[0] * 12, (3, [0]), 3, 1, 3, 2, 0, *[3] * 20]:
        live = [b for b, r in enumerate(reqs) if r.finish_reason is None]
        if isinstance(d, tuple):
            d, live = d
        if live:
            executor.round(reqs, live, d)
    assert all(r.finish_reason == "length" for r in reqs)
    assert split  # the round after row 0 drafted alone: it had ≤ 4 pending, the others ≥ 13
    accepted = sum(r.stats.accepted_draft_tokens for r in reqs)
    assert 0 < accepted < sum(r.stats.proposed_tokens for r in reqs)
    checked = check_rounds(target, draft, proposer.rounds)
    assert len(proposer.rounds) >= 6 and checked >= 40


def test_groups_bound_the_padding() -> None:
    assert groups([1, 30, 2, 4, 28], 4) == [[1, 4], [3, 2, 0]]
    assert groups([4, 1, 1, 3], 4) == [[0, 3, 1, 2]]  # steady state: one call
    assert groups([], 4) == []


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14]]


@pytest.mark.parametrize("kind", ["hf", "compiled"])
def test_greedy_equals_plain_greedy(kind: str) -> None:
    target = target_model()
    draft = Eagle3Draft.from_target(target, AUX, KEEP)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    runner = make_runner(kind, target)
    spec = SpecExecutor(runner, EagleProposer(runner, draft), 3).generate(PROMPTS, params)
    plain = SpecExecutor(make_runner(kind, target)).generate(PROMPTS, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert sum(c.stats.accepted_draft_tokens for c in spec) > 0


def test_greedy_through_the_scheduler_with_more_requests_than_slots() -> None:
    """Admission into used rows and release, requests that end before any draft round."""
    target = target_model()
    runner = CompiledRunner(target, compile=False)
    proposer = EagleProposer(runner, Eagle3Draft.from_target(target, AUX, KEEP))
    scheduler = Scheduler(SpecExecutor(runner, proposer, 3), slots=2)
    prompts = [*PROMPTS, [5, 5], [2, 30, 31]]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (9, 1, 12, 2, 15, 7)]
    tickets = [scheduler.submit(p, s) for p, s in zip(prompts, params, strict=True)]
    scheduler.run_until_idle()
    plain = SpecExecutor(HFRunner(target))
    for ticket, prompt, p in zip(tickets, prompts, params, strict=True):
        assert ticket.token_ids == plain.generate([prompt], p)[0].token_ids
    assert sum(t.stats.proposed_tokens for t in tickets) > 0


def test_scheduler_rounds_draft_from_aligned_states() -> None:
    """More requests than slots, sampled: admissions (one a long prompt) into a running batch,
    releases, rows ending at different times. Every round's q of every drafting row equals the
    head run from scratch over its committed tokens; after each step a running row holds at
    most D + 1 pending states, and only an admitted prompt's own call (alone) is wider."""
    target = target_model()
    draft = random_draft(target)
    runner = CompiledRunner(target, compile=False)
    proposer = Recording(runner, draft)
    calls: list[tuple[int, int]] = []  # (rows, pairs) of each call of the head's layer
    layer = draft.layer

    def spy(embeds, *args, **kwargs):
        calls.append((embeds.shape[0], embeds.shape[1]))
        return layer(embeds, *args, **kwargs)

    draft.layer = spy
    scheduler = Scheduler(SpecExecutor(runner, proposer, 3), slots=3, policy=DraftPolicy(3))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [*range(20, 32), *range(12)],
               [11, 12, 13, 14], [5, 5], [2, 30, 31]]
    budgets = (9, 1, 12, 6, 15, 7, 10)
    tickets = [scheduler.submit(p, SamplingParams(temperature=0.8, seed=i, max_tokens=n))
               for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))]
    while scheduler.step() or scheduler.waiting:
        for slot, ticket in enumerate(scheduler._tickets):
            if ticket is not None and ticket.finish_reason is None:
                assert sum(len(c) for c in proposer._pending[slot]) <= 4, slot
    assert [t.finish_reason for t in tickets] == ["length"] * len(tickets)
    wide = [c for c in calls if c[1] > 4]
    assert (1, 23) in wide and all(rows == 1 for rows, _ in wide)
    del draft.layer
    accepted = sum(t.stats.accepted_draft_tokens for t in tickets)
    assert 0 < accepted < sum(t.stats.proposed_tokens for t in tickets)
    assert check_rounds(target, draft, proposer.rounds) >= 40


def test_kept_prompts_keep_the_head_s_cache_and_draft_from_aligned_states() -> None:
    """The scheduler's kept prompt (the exactness audit's long prompt): a slot that keeps a
    prompt admits it again by the target scoring its last token only; the head keeps the
    prompt's pairs, takes that one state, and every round's q still equals the head run from
    scratch over the committed tokens."""
    target = target_model()
    draft = random_draft(target)
    runner = CompiledRunner(target, compile=False)
    proposer = Recording(runner, draft)
    fed = count_fed(runner)
    scheduler = Scheduler(SpecExecutor(runner, proposer, 3), slots=2, policy=DraftPolicy(3),
                          keep_prompts=True)
    prompt = [*range(20, 32), *range(12)]
    tickets = [scheduler.submit(prompt if i % 3 else [4, 5, 6],
                                SamplingParams(temperature=0.8, seed=i, max_tokens=4 + i % 5))
               for i in range(10)]
    scheduler.run_until_idle()
    assert [t.finish_reason for t in tickets] == ["length"] * len(tickets)
    assert fed.count(1) >= 3  # admissions from a kept prompt
    assert check_rounds(target, draft, proposer.rounds) >= 20


def test_default_aux_layers() -> None:
    assert default_aux_layers(32) == [1, 15, 28]
    assert default_aux_layers(6) == [1, 2, 2]
    assert default_aux_layers(2) == [1, 0, 0]
    assert Eagle3Draft.from_target(target_model()).aux_layers == [1, 2, 2]


def seeded_outputs(target, draft: Eagle3Draft) -> list[list[int]]:
    runner = HFRunner(target)
    params = [SamplingParams(seed=i, max_tokens=8) for i in range(len(PROMPTS))]
    executor = SpecExecutor(runner, EagleProposer(runner, draft), 3)
    return [c.token_ids for c in executor.generate(PROMPTS, params)]


@pytest.mark.parametrize("own", [False, True], ids=["target_embeddings", "own_embeddings"])
def test_save_load_round_trip(tmp_path, own: bool) -> None:
    target = target_model()
    draft = random_draft(target, own_embeddings=own)
    save_eagle3(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    assert config["draft_vocab_size"] == 24 and config["vocab_size"] == 32
    loaded = load_eagle3(tmp_path, target)
    assert loaded.config == draft.config
    ours, theirs = draft.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys() and ("embed_tokens.weight" in ours) == own
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert seeded_outputs(target, loaded) == seeded_outputs(target, draft)


def public_checkpoint(folder, *, hidden: int = 32, prefix: str = "midlayer.",
                      drop: str | None = None, reshape: str | None = None,
                      file: str = "model.safetensors") -> dict[str, torch.Tensor]:
    """An EAGLE-3 folder written by hand in the published layout (as SpecForge saves it)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(3)
    h, i, v, vd = hidden, 64, 32, 24
    shapes = {"fc.weight": [h, 3 * h], "norm.weight": [h], "lm_head.weight": [vd, h]}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        shapes[f"{prefix}{n}.weight"] = [h]
    for n, rows in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16)):
        shapes[f"{prefix}self_attn.{n}.weight"] = [rows, 2 * h]
    shapes[f"{prefix}self_attn.o_proj.weight"] = [h, 32]
    shapes |= {f"{prefix}mlp.gate_proj.weight": [i, h], f"{prefix}mlp.up_proj.weight": [i, h],
               f"{prefix}mlp.down_proj.weight": [h, i]}
    tensors = {k: torch.randn(s, generator=gen) * 0.2 for k, s in shapes.items()}
    tensors["d2t"] = KEEP - torch.arange(vd)
    tensors["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill(0, KEEP, True)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][..., :-1].contiguous()
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": h, "intermediate_size": i, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 256, "num_hidden_layers": 1,
              "hidden_act": "silu", "vocab_size": v, "draft_vocab_size": vd,
              "torch_dtype": "float32", "eagle_config": {
                  "eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True}}
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if file.endswith(".safetensors"):
        save_file(tensors, str(folder / file))
    else:
        torch.save(tensors, folder / file)
    return tensors


@pytest.mark.parametrize("prefix,file", [("midlayer.", "model.safetensors"),
                                         ("layers.0.", "pytorch_model.bin")])
def test_a_public_layout_checkpoint_loads_and_drafts(tmp_path, prefix: str, file: str) -> None:
    target = target_model()
    written = public_checkpoint(tmp_path, prefix=prefix, file=file)
    draft = load_eagle3(tmp_path, target)
    assert draft.embed_tokens is None and draft.aux_layers == AUX
    assert torch.equal(draft.fc.weight, written["fc.weight"])
    assert torch.equal(draft.midlayer.self_attn.k_proj.weight,
                       written[f"{prefix}self_attn.k_proj.weight"])
    assert torch.equal(draft.target_ids, KEEP)
    assert draft.config.extra["eagle_config"]["use_aux_hidden_state"] is True
    out = seeded_outputs(target, draft)
    assert all(len(o) == 8 for o in out)


@pytest.mark.parametrize("change,named", [
    ({"drop": "midlayer.hidden_norm.weight"}, "tensor midlayer.hidden_norm.weight is missing"),
    ({"reshape": "midlayer.self_attn.q_proj.weight"},
     "tensor midlayer.self_attn.q_proj.weight has shape [32, 63], expected [32, 64]"),
    ({"drop": "lm_head.weight"}, "tensor lm_head.weight is missing"),
    ({"drop": "d2t"}, "tensor d2t is missing"),
])
def test_a_bad_tensor_is_named(tmp_path, change: dict, named: str) -> None:
    public_checkpoint(tmp_path, **change)
    with pytest.raises(HeadsError) as e:
        load_eagle3(tmp_path, target_model())
    assert named in str(e.value) and "\n" not in str(e.value)


def test_a_bad_folder_config_or_size_is_named(tmp_path) -> None:
    target = target_model()
    with pytest.raises(HeadsError, match="no such heads directory"):
        load_eagle3(tmp_path / "absent", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadsError, match=r"config\.json: missing"):
        load_eagle3(tmp_path / "empty", target)
    public_checkpoint(tmp_path / "wide", hidden=48)
    with pytest.raises(HeadsError, match="hidden_size 48 ≠ the target's 32"):
        load_eagle3(tmp_path / "wide", target)
    public_checkpoint(tmp_path / "deep")
    config = json.loads((tmp_path / "deep" / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 6]
    (tmp_path / "deep" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsError, match=r"\[1, 3, 6\] are not 3 layers of the target's 6"):
        load_eagle3(tmp_path / "deep", target)


@pytest.mark.parametrize("key,value,named", [
    ("hidden_size", None, "hidden_size must be an integer ≥ 1, got None"),
    ("hidden_size", "32", "hidden_size must be an integer ≥ 1, got '32'"),
    ("hidden_size", "absent", "no hidden_size"),
    ("intermediate_size", 64.5, "intermediate_size must be an integer ≥ 1, got 64.5"),
    ("num_attention_heads", 0, "num_attention_heads must be an integer ≥ 1, got 0"),
    ("num_key_value_heads", 3, "num_attention_heads 4 is not a multiple of num_key_value_heads"),
    ("head_dim", "8", "head_dim must be an integer ≥ 1, got '8'"),
    ("draft_vocab_size", [24], "draft_vocab_size must be an integer ≥ 1, got [24]"),
    ("max_position_embeddings", True, "max_position_embeddings must be an integer ≥ 1"),
    ("rms_norm_eps", "small", "rms_norm_eps must be a positive number, got 'small'"),
    ("rope_theta", -1, "rope_theta must be a positive number, got -1"),
    ("rope_scaling", "linear", "rope_scaling must be an object, got 'linear'"),
    ("rope_scaling", {"rope_type": "warp"}, "rope_scaling {'rope_type': 'warp'} is not usable"),
    ("eagle_config", 5, "eagle_config must be an object, got 5"),
    ("aux", 5, "eagle_config.eagle_aux_hidden_state_layer_ids 5 are not 3 layers"),
    ("aux", ["1", "3", "4"], "eagle_aux_hidden_state_layer_ids ['1', '3', '4'] are not 3"),
])
def test_a_mistyped_config_value_is_named(tmp_path, key: str, value, named: str) -> None:
    """null, strings, numbers of the wrong kind: one line naming config.json and the key."""
    public_checkpoint(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    if key == "aux":
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = value
    elif value == "absent":
        del config[key]
    else:
        config[key] = value
    path.write_text(json.dumps(config))
    with pytest.raises(HeadsError) as e:
        load_eagle3(tmp_path, target_model())
    message = str(e.value)
    assert message.startswith(f"{path}: ") and named in message and "\n" not in message


def test_a_target_without_llama_layers_is_refused_in_one_line() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=64, n_embd=32, n_layer=2,
                                      n_head=4))
    runner = SimpleNamespace(model=gpt2, vocab_size=32, capture_hidden=lambda layers: None)
    draft = Eagle3Draft.from_target(target_model(), AUX, KEEP)
    want = "eagle3 heads need a Llama-family target (decoder layers + final norm): gpt2"
    with pytest.raises(HeadsError, match=re.escape(want)):
        EagleProposer(runner, draft)
    with pytest.raises(HeadsError, match=re.escape(want)):
        Eagle3Draft.from_target(gpt2)


def test_rope_stays_float32_in_a_bf16_head(tmp_path) -> None:
    """A bf16 head (cast, made from a bf16 target, or loaded for one) computes RoPE from a
    float32 inv_freq: cos/sin at position 2000 as float32's up to bf16 rounding (a bf16
    inv_freq is off by ~0.3 there)."""
    target = target_model()
    head32 = Eagle3Draft.from_target(target, AUX, KEEP)
    save_eagle3(head32, tmp_path)
    positions = torch.tensor([[0, 1, 100, 2000]])
    x = torch.zeros(1, 4, 64)
    want = head32.rotary_emb(x, positions)
    bf16 = target.to(torch.bfloat16)
    for head in (copy.deepcopy(head32).to(torch.bfloat16),
                 Eagle3Draft.from_target(bf16, AUX, KEEP), load_eagle3(tmp_path, bf16)):
        assert head.lm_head.weight.dtype == torch.bfloat16
        assert all(b.dtype == torch.float32 for b in head.rotary_emb.buffers())
        got = head.rotary_emb(x.bfloat16(), positions)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.bfloat16 and (g.float() - w).abs().max() < 1e-2
        with torch.no_grad():
            g, logits = head(torch.ones(1, 2, 32, dtype=torch.bfloat16),
                             torch.ones(1, 2, 32, dtype=torch.bfloat16), positions[:, 2:])
        assert logits.dtype == torch.bfloat16 and logits.isfinite().all()
    assert all(b.dtype == torch.float32 for b in head32.float().rotary_emb.buffers())


def test_from_target_starts_as_the_last_layer_on_the_high_state() -> None:
    """fc passes the high state through and the embedding half of q/k/v is zero, so the head's
    first step is the target's last layer (attention over the head's own pairs) + norm + head
    rows of the kept ids."""
    target = target_model()
    draft = Eagle3Draft.from_target(target, AUX, KEEP)
    assert isinstance(draft.config, Eagle3Config) and draft.config.draft_vocab_size == 24
    aux = torch.randn(1, 5, 96)
    with torch.no_grad():
        h = draft.fuse(aux)
        assert torch.equal(h, aux[..., 64:])
        embeds = torch.randn(1, 5, 32)
        g, logits = draft(embeds, h, torch.arange(5)[None])
        last = target.model.layers[-1]
        rotary = target.model.rotary_emb(h, torch.arange(5)[None])
        want = last(h, attention_mask=None, position_ids=torch.arange(5)[None],
                    position_embeddings=rotary)
        want = want[0] if isinstance(want, tuple) else want
        # the stock layer without a mask attends to every position: compare the last one
        assert torch.allclose(g[0, -1], want[0, -1], atol=1e-5)
        full = target.lm_head(target.model.norm(g))
        assert torch.allclose(draft.target_logits(logits)[..., KEEP], full[..., KEEP],
                              atol=1e-5)
        assert draft.target_logits(logits)[..., 1].isneginf().all()
