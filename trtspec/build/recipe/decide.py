"""The ``decide`` section of a recipe: what a verdict asks of the measurements."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from trtspec.spec.methods import Strict


class Slo(Strict):
    """A service-level objective per request, as vLLM's and SGLang's goodput count it: a
    request meets it when its TTFT and its TPOT are each within their limit (a limit left out
    is not checked; a one-token output has no TPOT and meets that part)."""

    ttft_ms: float | None = Field(None, gt=0, description="time to first token, ms")
    tpot_ms: float | None = Field(None, gt=0, description="time per output token after the "
                                  "first, ms")

    @model_validator(mode="after")
    def _some_limit(self) -> Slo:
        if self.ttft_ms is None and self.tpot_ms is None:
            raise ValueError("an slo needs ttft_ms, tpot_ms or both")
        return self


class Decide(Strict):
    """Filled in by the decide step; validated now."""

    primary_metric: Literal["tpot", "tpot_p50", "e2e_p50", "e2e_per_token_p50", "goodput"] = Field(
        "tpot_p50", description="tpot: geometric mean over requests of each one's baseline / "
        "spec TPOT (paired, the most decisive); tpot_p50, e2e_p50, e2e_per_token_p50: baseline "
        "/ spec median of TPOT, E2E, or E2E per output token (a per-request latency: "
        "`throughput` in older recipes, which is read as this); goodput: spec / baseline "
        "requests per second that meet `slo`")
    min_speedup: float = Field(1.05, gt=0, description="GO needs the speedup shown above this "
                               "(one-sided, Holm over the report's cells); NO-GO when shown "
                               "below")
    # The tail a latency gate judges is p99 from 100 paired requests, p90 from 20, else the
    # median; the gate fails only when the regression's 95 % CI lies above the limit.
    max_ttft_p99_regression: float = Field(0.10, ge=0, description="TTFT tail regression limit "
                                           "(spec / baseline − 1)")
    max_e2e_p99_regression: float = Field(0.10, ge=0, description="E2E tail regression limit "
                                          "(spec / baseline − 1)")
    min_requests: int = Field(20, ge=1, description="fewer paired requests give no verdict "
                              "(per condition and per category)")
    greedy_tie_margin: float | None = Field(
        None, ge=0, description="at temperature 0, a spec output that first differs from the "
        "baseline where the target's two logits are within this margin is a numerical tie, "
        "not a failure (bf16 forwards of 1 and D+1 tokens may order near-ties differently); "
        "null: by the dtype the margin was measured in (float32 0.01, float16 0.1, "
        "bfloat16 0.5)")
    require_audit: bool = Field(True, description="no GO without a passing `trtspec audit`")
    min_gpu_memory_headroom: float = Field(0.10, ge=0, lt=1,
                                           description="GPU memory that must stay free at peak")
    slo: Slo | None = Field(None, description="the latency a request must meet to count in "
                            "goodput (TTFT and TPOT, each optional); needed by "
                            "primary_metric: goodput")

    @field_validator("primary_metric", mode="before")
    @classmethod
    def _throughput_is_a_latency(cls, value: object) -> object:
        """``throughput`` was the median E2E per output token of single requests, not tokens
        per second of the arm: named for what it is, the old name still read."""
        return "e2e_per_token_p50" if value == "throughput" else value

    @model_validator(mode="after")
    def _goodput_needs_slo(self) -> Decide:
        if self.primary_metric == "goodput" and self.slo is None:
            raise ValueError("primary_metric goodput counts the requests that meet an SLO: "
                             "set decide.slo (e.g. {ttft_ms: 500, tpot_ms: 50})")
        return self
