"""Hidden states the runners keep for heads: the model's own layer outputs at the positions fed,
from the scoring forward itself, through ragged batches, deduplicated prefills and rollbacks."""

import pytest
import torch
from conftest import tiny_llama

from trtspec.runtime.compiled import CompiledRunner
from trtspec.runtime.hf import HFRunner, layer_outputs
from trtspec.runtime.toy import ToyRunner
from trtspec.spec.propose.heads import captured

LAYERS = [1, -1, 0]


def reference(model, sequence: list[int]) -> torch.Tensor:
    """[T, 3H] the asked layers' outputs over the whole sequence, one plain forward."""
    with torch.inference_mode(), layer_outputs(model, LAYERS) as kept:
        model(torch.tensor([sequence]))
    return torch.cat(kept, dim=-1)[0]


def make(kind: str, model):
    return HFRunner(model) if kind == "hf" else CompiledRunner(model, compile=False)


@pytest.mark.parametrize("kind", ["hf", "compiled"])
def test_captured_states_are_the_model_s_own_at_each_position_fed(kind: str) -> None:
    model = tiny_llama(vocab=32, layers=3, seed=2)
    runner = make(kind, model)
    runner.capture_hidden(LAYERS)
    prompts = [[3, 1, 4, 1, 5], [9, 2], [3, 1, 4, 1, 5]]  # a repeat: HF computes it once
    runner.prefill(prompts)
    cap = captured(runner)
    assert cap.counts == [5, 2, 5]
    for b, p in enumerate(prompts):
        torch.testing.assert_close(cap.row(b), reference(model, p), atol=1e-5, rtol=1e-4)
    # a ragged verify-like call, then a rollback and another call: positions follow the rows
    feed = [[7, 8, 9], [], [6]]
    runner.score(feed)
    cap = captured(runner)
    assert cap.counts == [3, 0, 1] and cap.row(1).shape[0] == 0  # a row fed nothing
    torch.testing.assert_close(cap.row(0), reference(model, prompts[0] + feed[0])[5:],
                               atol=1e-5, rtol=1e-4)
    runner.rollback([6, 2, 6])  # keep 7 of row 0; drop nothing else
    runner.score([[5], [4, 4], []], last_only=True)
    cap = captured(runner)
    assert cap.states.shape[:2] == (2, 2)  # rows 0-1 only; every position fed, last_only too
    torch.testing.assert_close(cap.at([0, 1], [0, 1]),
                               torch.stack([reference(model, [*prompts[0], 7, 5])[-1],
                                            reference(model, [9, 2, 4, 4])[-1]]),
                               atol=1e-5, rtol=1e-4)
    runner.score([[], [], [8]])  # one row alone (an admission): only its states are kept
    cap = captured(runner)
    assert cap.first == 2 and cap.states.shape[0] == 1
    with pytest.raises(RuntimeError, match=r"hidden position 1 .* fed it 1 tokens"):
        cap.at([2], [1])
    runner.capture_hidden([])  # another executor's turn (the baseline arm): nothing kept
    runner.score([[1], [], []])
    assert runner.hidden is None


def test_a_layer_skip_view_keeps_nothing_and_leaves_the_target_s_states() -> None:
    model = tiny_llama(vocab=32, layers=3, seed=2)
    runner = CompiledRunner(model, compile=False)
    runner.capture_hidden([-1])
    runner.prefill([[1, 2, 3]])
    before = runner.hidden.clone()
    view = runner.view(1, share_cache=True)
    view.follow()
    view.score([[4]])
    assert view.hidden is None
    torch.testing.assert_close(runner.hidden, before)


def test_layer_numbers_out_of_range_and_toy_runners_say_so() -> None:
    runner = HFRunner(tiny_llama(layers=2))
    with pytest.raises(ValueError, match="layer 2 is out of range for a model of 2 layers"):
        runner.capture_hidden([2])
    toy = ToyRunner.__new__(ToyRunner)
    with pytest.raises(ValueError, match="no hidden states"):
        toy.capture_hidden([0])


def test_a_compiler_failure_mid_forward_keeps_the_eager_rerun_s_states(monkeypatch) -> None:
    """The compiled graph fails on the second layer of a call: the eager re-run's states are the
    ones kept (none of the failed attempt's), at the same positions."""
    def flaky(fn, **kw):
        calls = [0]

        def call(*a, **k):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("the compiler gave up")
            return fn(*a, **k)
        return call

    monkeypatch.setattr(torch, "compile", flaky)
    model = tiny_llama(vocab=32, layers=3, seed=2)
    lines: list[str] = []
    runner = CompiledRunner(model, warn=lines.append)
    runner.capture_hidden(LAYERS)
    prompt = [3, 1, 4, 1, 5]
    runner.prefill([prompt])
    assert not runner.compiled and len(lines) == 1 and runner.lengths() == [5]
    torch.testing.assert_close(captured(runner).row(0), reference(model, prompt),
                               atol=1e-5, rtol=1e-4)
