"""A toy eval in its own process, for the kill-and-resume test: python eval_driver.py OUT [--resume]
[--step-delay S]."""

from __future__ import annotations

import sys
import time

from trtspec.eval.run import Condition, EvalInputs, run_eval
from trtspec.eval.workloads.request import WorkloadRequest
from trtspec.runtime.toy import MarkovLM, ToyRunner
from trtspec.spec.executor import SpecExecutor
from trtspec.spec.propose.draft_model import DraftModelProposer
from trtspec.spec.sample.probs import SamplingParams


class SlowRunner(ToyRunner):
    """A toy runner that takes its time, so a kill lands mid-eval."""

    delay = 0.0

    def score(self, tokens, last_only=False):
        time.sleep(self.delay)
        return super().score(tokens, last_only)


def toy_inputs(n_requests: int = 6, delay: float = 0.0) -> EvalInputs:
    SlowRunner.delay = delay
    target = MarkovLM(vocab_size=16, order=2, seed=3, eos_token_id=15)
    draft = target.diverged(0.3, seed=4)

    def make(condition: Condition, arm: str) -> SpecExecutor:
        if arm == "baseline":
            return SpecExecutor(SlowRunner(target))
        return SpecExecutor(SlowRunner(target), DraftModelProposer(ToyRunner(draft)),
                            condition.draft_len)

    requests = [WorkloadRequest(id=f"r{i}", category=("copy", "chat")[i % 2],
                                prompt=" ".join(str((i + k) % 15) for k in range(3 + i)))
                for i in range(n_requests)]
    conditions = [Condition("draft_model", d, c) for d in (2, 4) for c in (1, 2)]
    return EvalInputs(requests, conditions, make,
                      encode=lambda r: [int(t) for t in (r.prompt or "").split()],
                      sampling=SamplingParams(temperature=1.0, max_tokens=12, seed=1), warmup=1)


if __name__ == "__main__":
    delay = float(sys.argv[sys.argv.index("--step-delay") + 1]) if "--step-delay" in sys.argv \
        else 0.0
    run_eval(sys.argv[1], toy_inputs(delay=delay), resume="--resume" in sys.argv)
