"""`trtspec distill`: heads trained on the target's own text get closer to it on held-out text,
the folder they land in loads, a budget stop resumes where it stopped, the training prompts are
not the eval's, and bad input is one line with exit 2."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

from trtspec.eval.workloads import builtin
from trtspec.report.tracking.distill import log_distill
from trtspec.train.config import DistillConfig, DistillError
from trtspec.train.data import Teacher, draft_vocab, load_prompts, training_prompts
from trtspec.train.distill import distill, expected_al
from trtspec.train.trainers import eagle_step2

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu-smollm2.yaml"


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls on a shared 2-core machine: one thread runs them ~10× faster than two
    threads spinning against other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def target():
    return tiny_llama(vocab=64, layers=6, seed=0, logit_scale=8.0)  # peaked: learnable


def prompts(n: int = 120, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (int(torch.randint(3, 8, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def quiet(_: str) -> None:
    pass


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_distilled_heads_agree_more_with_the_target_and_load(method: str, tmp_path: Path
                                                             ) -> None:
    from trtspec.spec.propose.heads.eagle_model import load_eagle3
    from trtspec.spec.propose.heads.medusa import load_medusa

    model = target()
    weights = [p.detach().clone() for p in model.parameters()]
    out = tmp_path / "heads"
    result = distill(model, prompts(), out, DistillConfig(
        method=method, epochs=6, lr=1e-2, max_new_tokens=32, max_len=48, batch_tokens=512,
        draft_vocab=48, minutes=None), target="tiny", recipe="tiny-recipe", say=quiet)
    assert result.stopped == "epochs" and result.epochs == 6
    assert [h["epoch"] for h in result.history] == list(range(7))  # epoch 0: before training
    assert result.history[-1]["agreement"][0] > result.history[0]["agreement"][0]
    assert len(result.history[-1]["agreement"]) == (2 if method == "eagle" else 4)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert all(p.requires_grad for p in model.parameters())  # the target's flags restored
    info = json.loads((out / "distill.json").read_text())
    assert info["method"] == method and info["target"] == "tiny" and info["epochs"] == 6
    assert info["sequences"] == 120 and info["heldout_sequences"] == 12
    assert info["agreement"] == result.agreement and info["al_d4"] >= 1
    assert info["training_tokens"] == 6 * info["epoch_tokens"] == result.tokens
    if method == "eagle":
        draft = load_eagle3(out, model)
        assert draft.config.draft_vocab_size == info["draft_vocab"] == 48
        assert draft.target_ids.tolist() == sorted(set(draft.target_ids.tolist()))
    else:
        heads = load_medusa(out, model)
        assert heads.num_heads == 4 and info["draft_vocab"] is None


def test_eagle_step_two_is_what_the_draft_computes_decoding_with_its_cache() -> None:
    """The unrolled second step (one batched pass with a [T, 2T] mask) equals the draft run as
    the proposer runs it: the step-1 pairs of positions ≤ t in its cache, then (g_t, e) at
    position t + 1."""
    from trtspec.spec.propose.heads.eagle_model import Eagle3Draft

    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(tiny_llama(vocab=64, layers=6, seed=3)).float()
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the zero halves too
    steps, hidden = 7, draft.config.hidden_size
    e1, h1 = torch.randn(1, steps, hidden), torch.randn(1, steps, hidden)
    e2 = torch.randn(1, steps - 1, hidden)
    with torch.no_grad():
        g, _ = draft(e1, h1, torch.arange(steps)[None])
        batched = eagle_step2(draft, e1, h1, e2, g[:, :-1])  # [1, T − 1, Vd]
        for t in range(steps - 1):
            cache, rows = draft.new_cache(1), torch.tensor([0])
            draft(e1[:, : t + 1], h1[:, : t + 1], torch.arange(t + 1)[None], cache, rows)
            _, logits = draft(e2[:, t: t + 1], g[:, t: t + 1], torch.tensor([[t + 1]]), cache,
                              rows)
            torch.testing.assert_close(batched[:, t], logits[:, 0], atol=1e-5, rtol=1e-4)


def test_a_budget_stop_resumes_where_it_stopped(tmp_path: Path) -> None:
    """Stopped by --tokens one batch into epoch 2, resumed: the epochs, steps and weights go on
    as if never stopped; a resume of another run is refused in one line."""
    model, data = target(), prompts(60)
    config = DistillConfig(method="medusa", epochs=3, lr=1e-2, max_new_tokens=16, max_len=32,
                           batch_tokens=256, minutes=None)
    whole = distill(model, data, tmp_path / "whole", config, target="tiny", recipe="r",
                    say=quiet)
    out = tmp_path / "heads"
    first = distill(model, data, out, replace(config, tokens=whole.epoch_tokens + 1),
                    target="tiny", recipe="r", say=quiet)
    assert first.stopped == "tokens" and first.epochs == 1
    assert [(h["epoch"], h["complete"]) for h in first.history] == [(0, True), (1, True),
                                                                    (2, False)]
    assert json.loads((out / "distill.json").read_text())["stopped"] == "tokens"
    said: list[str] = []
    second = distill(model, data, out, config, target="tiny", recipe="r", resume=True,
                     say=said.append)
    assert any(s.startswith("reusing 60 sequences") for s in said)
    assert any(s.startswith("resuming at epoch 2, batch 1") for s in said)
    assert second.stopped == "epochs" and second.epochs == 3
    assert [h["epoch"] for h in second.history] == [0, 1, 2, 3]
    assert second.loss_curve == whole.loss_curve  # the same steps, bit for bit (CPU)
    assert second.history == whole.history and second.tokens == whole.tokens
    for changed, text in ((replace(config, method="eagle"), "method 'medusa', not 'eagle'"),
                          (replace(config, num_heads=3), "data or settings differ")):
        with pytest.raises(DistillError, match=text):
            distill(model, data, out, changed, target="tiny", recipe="r", resume=True,
                    say=quiet)
    with pytest.raises(DistillError, match="data or settings differ"):
        distill(model, data[:-1], out, config, target="tiny", recipe="r", resume=True,
                say=quiet)
    with pytest.raises(DistillError, match="recipe 'r', not 'other'"):
        distill(model, data, out, config, target="tiny", recipe="other", resume=True,
                say=quiet)
    with pytest.raises(DistillError, match="no checkpoint"):
        distill(model, data, tmp_path / "none", config, target="tiny", recipe="r",
                resume=True, say=quiet)


def test_training_prompts_are_not_the_eval_s() -> None:
    train = training_prompts()
    assert len(train) >= 400 and len({r.prompt for r in train}) == len(train)
    assert {r.category for r in train} == {r.category for r in builtin()}
    assert not {r.prompt for r in train} & {r.prompt for r in builtin()}
    assert training_prompts() == train  # seeded

    def runs(text: str, n: int = 8) -> set[tuple[str, ...]]:
        words = text.split()
        return {tuple(words[i: i + n]) for i in range(len(words) - n + 1)}

    # not near-copies either: no training prompt shares a run of 8 words with an eval prompt
    # (instruction stems such as "Write a short story about a" are shared: same categories)
    evaluated = set().union(*(runs(r.prompt) for r in builtin()))
    assert not [r.id for r in train if runs(r.prompt) & evaluated]


def test_prompt_specs(tmp_path: Path) -> None:
    from trtspec.eval.workloads.request import WorkloadError

    requests, warning = load_prompts("builtin")
    assert len(requests) == 48 and "in-distribution" in warning
    assert load_prompts("train")[1] is None
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "hi"}\n')
    assert [r.prompt for r in load_prompts(str(path))[0]] == ["hi"]
    with pytest.raises(WorkloadError, match="not found under"):
        load_prompts(f"speed-bench:{tmp_path}")


def test_draft_vocabulary_is_the_commonest_ids_and_the_special_ones() -> None:
    teacher = Teacher(tokens=[torch.tensor([5, 5, 5, 7, 7, 9])],
                      states=[torch.zeros(6, 1)], probs=[torch.ones(6, 1).half()],
                      ids=[torch.tensor([[5], [5], [7], [7], [7], [3]]).int()])
    assert draft_vocab(teacher, [0], 3, 16, always=[15]).tolist() == [5, 7, 15]
    assert draft_vocab(teacher, [0], 50, 16).tolist() == list(range(16))  # capped at V


def test_expected_acceptance_length() -> None:
    assert expected_al([0.5] * 4, 4, "medusa")[0] == pytest.approx(1.9375)
    assert expected_al([0.5, 0.5], 4, "medusa") == (pytest.approx(1.75), "heads 1–2 measured")
    al, note = expected_al([0.5, 1.0], 4, "eagle")
    assert al == pytest.approx(3.0) and "step 2's α" in note


def test_mlflow_down_is_one_line_and_the_heads_stay(tmp_path: Path) -> None:
    from conftest import free_port

    from trtspec.report.tracking.client import TrackingUnavailable

    result = distill(target(), prompts(12), tmp_path / "h", DistillConfig(
        method="medusa", epochs=1, max_new_tokens=4, max_len=16, minutes=None),
        target="tiny", recipe="r", say=quiet)
    with pytest.raises(TrackingUnavailable, match="unreachable"):
        log_distill(result, f"http://127.0.0.1:{free_port()}")
    assert (tmp_path / "h" / "medusa_lm_head.safetensors").is_file()


# ---- the command ----------------------------------------------------------------------------

@pytest.fixture
def trtspec(monkeypatch: pytest.MonkeyPatch):
    """`trtspec …` in process, with distill registered (as trtspec.cli registers it)."""
    from trtspec.cli import cli, main
    from trtspec.cli.distill import distill as command

    monkeypatch.setitem(cli.commands, "distill", command)
    return main


def fails(main, args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_command_errors_are_one_line(trtspec, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    out = ["--out", str(tmp_path / "out")]
    for args, text in (
            (["--method", "lstm"], "Invalid value for '--method'"),
            (["--method", "medusa"], "has no medusa method to take the heads' path from: give "
                                     "--out DIR"),
            (["--method", "eagle", *out, "--prompts", "nope.jsonl"],
             "--prompts nope.jsonl: not train, builtin, speed-bench[:DIR] or a JSONL file"),
            (["--method", "eagle", *out, "--prompts", str(bad)], "bad.jsonl:1: not JSON"),
            (["--method", "medusa", *out, "--minutes", "0"], "--minutes must be > 0"),
            (["--method", "eagle", *out, "--tokens", "-5"], "--tokens must be > 0"),
            (["--method", "eagle", *out, "--resume"], "--resume: no checkpoint in")):
        assert text in fails(trtspec, ["distill", str(RECIPE), *args], capsys)
    assert not (tmp_path / "out").exists()


def test_command_distills_the_demo_target(trtspec, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The real offline model, three prompts, 500 training tokens: distill.json, a folder that
    loads, and one MLflow run with the loss curve."""
    from mlflow.tracking import MlflowClient

    from trtspec.runtime.models import load
    from trtspec.spec.propose.heads.eagle_model import load_eagle3

    monkeypatch.chdir(tmp_path)
    Path("p.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in
                                       enumerate(["Write a haiku about rain.", "What is 7 × 8?",
                                                  "Name three rivers in Europe."])))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    trtspec(["distill", str(RECIPE), "--method", "eagle", "--prompts", "p.jsonl",
             "--max-new-tokens", "8", "--tokens", "500", "--out", "tmp", "--mlflow-uri", uri])
    printed = capsys.readouterr().out
    assert "held-out top-1 agreement" in printed and "MLflow: logged as run" in printed
    info = json.loads(Path("tmp/distill.json").read_text())
    assert info["sequences"] == 3 and info["heldout_sequences"] == 1
    assert info["stopped"] == "tokens" and info["training_tokens"] >= 500
    assert info["recipe"] == "cpu-smollm2" and info["prompts"] == "p.jsonl"
    draft = load_eagle3("tmp", load("smollm2-135m-instruct", device="cpu").model)
    assert draft.config.draft_vocab_size == info["draft_vocab"] == 16384
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("trtspec-distill-cpu-smollm2")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.params["method"] == "eagle" and "train/loss" in run.data.metrics
    assert "heldout/agreement_1" in run.data.metrics
