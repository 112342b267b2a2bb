"""schedules: the policy file round trip, each stack's method mapping, c* → draft_len_schedule,
and every emitted option name against the names the stack documents for that release."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from trtllm_fields import FIELDS, check_config

from trtspec.analysis.policy import ServePolicy, read_policy, write_policy
from trtspec.analysis.schedules import (
    deploy_schedule,
    trtllm_snippet,
    vllm_config,
    vllm_notes,
)
from trtspec.build.trtllm_options import at_least
from trtspec.spec.methods import DraftModel, Eagle, LayerSkip, Medusa, Ngram, Suffix

# vLLM --speculative-config keys. Source: vllm-project/vllm, vllm/config/speculative.py
# (SpeculativeConfig: method, model, num_speculative_tokens, prompt_lookup_max,
# prompt_lookup_min, suffix_decoding_max_tree_depth, suffix_decoding_max_spec_factor,
# suffix_decoding_min_token_prob, draft_tensor_parallel_size, quantization, revision), as on
# the main branch (suffix_decoding_* only in releases with suffix decoding).
VLLM = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob", "draft_tensor_parallel_size", "quantization",
        "revision"}

METHODS = [Ngram(method="ngram", min_n=2, max_n=4),
           DraftModel(method="draft_model", model="/models/draft"),
           Eagle(method="eagle", model="/models/eagle3"),
           Medusa(method="medusa", heads="/models/medusa", num_heads=3),
           Suffix(method="suffix"), LayerSkip(method="layer_skip", layers=8)]
STEPS = [(1, 4), (2, 4), (4, 2), (5, 2)]


@pytest.mark.parametrize("release", sorted(FIELDS))
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.method)
def test_trtllm_keys_are_the_releases(method, release: str, temperature: float) -> None:
    text = trtllm_snippet(method, STEPS, temperature, "e1", release)
    assert f"TensorRT-LLM {release}" in text  # the release is cited inside the snippet
    body = yaml.safe_load(text)
    newer = at_least(release, 1, 3)
    if method.method in ("suffix", "layer_skip") or (newer and method.method == "medusa"):
        assert body is None and "Nothing to configure here" in text
        return
    config = body["speculative_config"]
    check_config(config, release)
    assert "draft_len_schedule" in config and "max_concurrency" not in config
    assert ("use_rejection_sampling" in config) == (newer and temperature > 0)
    one_model = config["decoding_type"] in ("Eagle3", "MTP")
    assert ("allow_advanced_sampling" in config) == (not newer and one_model
                                                     and temperature > 0)
    assert ("check the server with `trtspec audit --endpoint" in text) == (temperature > 0)


def test_trtllm_method_mapping_in_1_2_1() -> None:
    types = {m.method: yaml.safe_load(trtllm_snippet(m, STEPS, 0, "e"))
             for m in METHODS[:4]}
    assert {k: v["speculative_config"]["decoding_type"] for k, v in types.items()} == {
        "ngram": "NGram", "draft_model": "Draft_Target", "eagle": "Eagle3", "medusa": "Medusa"}
    assert types["ngram"]["speculative_config"]["max_matching_ngram_size"] == 4
    assert types["draft_model"]["speculative_config"]["speculative_model"] == "/models/draft"
    old = Eagle(method="eagle", model="/m", version=2)
    assert yaml.safe_load(trtllm_snippet(old, STEPS, 0, "e"))["speculative_config"][
        "decoding_type"] == "Eagle"  # EAGLE-1/2: engines
    newer = yaml.safe_load(trtllm_snippet(METHODS[1], STEPS, 0, "e", "1.3.0"))
    assert newer["speculative_config"]["decoding_type"] == "DraftTarget"
    assert newer["speculative_config"]["draft_len_schedule"] == {1: 4, 2: 4, 4: 2, 5: 2}


def test_trtllm_snippets_parse_in_the_1_2_1_standin(trtllm_standin) -> None:
    from tensorrt_llm.llmapi import parse_speculative_config

    for method in METHODS[:4]:
        for temperature in (0.0, 0.7):
            config = yaml.safe_load(trtllm_snippet(method, STEPS, temperature, "e"))
            parsed = parse_speculative_config(config["speculative_config"])
            assert parsed.draft_len_schedule == {1: 4, 3: 2, 6: 0}


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.method)
def test_vllm_keys_and_mapping(method) -> None:
    config = vllm_config(method, STEPS)
    notes = vllm_notes(method, STEPS, "e1", 8)
    if method.method == "layer_skip":
        assert config is None and "no vllm-speculative.json" in notes
        return
    config = json.loads(json.dumps(config))
    assert set(config) <= VLLM
    assert config["method"] == {"ngram": "ngram", "draft_model": "draft_model",
                                "eagle": "eagle3", "medusa": "medusa",
                                "suffix": "suffix"}[method.method]
    assert config["num_speculative_tokens"] == 4  # the schedule's first D
    assert "[[1, 1, 4], [2, 2, 4], [3, 4, 2], [5, 5, 2], [6, 8, 0]]" in notes
    if method.method == "ngram":
        assert (config["prompt_lookup_min"], config["prompt_lookup_max"]) == (2, 4)


def test_the_schedule_stops_at_the_last_go_level() -> None:
    # measured levels 1, 2, 4, 8; D = 2 is GO at 4, nothing at 8: speculation stops above 4,
    # whatever the fitted c* between 4 and 8 (a point estimate, not a shown speedup)
    assert deploy_schedule([(1, 4), (2, 4), (4, 2), (8, 0)]) == [(1, 4), (2, 4), (4, 2)]
    assert deploy_schedule([(1, 4), (2, 0), (4, 0)]) == [(1, 4)]
    assert deploy_schedule([(1, 0)]) == []
    # TensorRT-LLM 1.2.1: draft_len_schedule keys are the smallest batch size a D applies
    # from, 1: max_draft_len first; the decision {1: 4, 2: 4, 4: 0} is D = 4 up to 2 requests
    text = trtllm_snippet(METHODS[0], [(1, 4), (2, 4), (4, 2)], 0, "e")
    config = yaml.safe_load(text)["speculative_config"]
    assert (config["max_draft_len"], config["draft_len_schedule"]) == (4, {1: 4, 3: 2, 5: 0})
    steps = deploy_schedule([(1, 4), (2, 4), (4, 0)])
    assert yaml.safe_load(trtllm_snippet(METHODS[0], steps, 0, "e"))["speculative_config"][
        "draft_len_schedule"] == {1: 4, 3: 0}
    newer = yaml.safe_load(trtllm_snippet(METHODS[0], [(1, 4), (2, 4), (4, 2)], 0, "e",
                                          "1.3.0rc1"))["speculative_config"]
    assert newer["draft_len_schedule"] == {1: 4, 2: 4, 4: 2}
    cpu = trtllm_snippet(METHODS[0], steps, 0, "e", measured_on="a CPU")
    assert "# Measured on a CPU: the batch sizes where speculation pays differ" in cpu


def test_policy_round_trip(tmp_path: Path) -> None:
    policy = ServePolicy("ngram", ((1, 4), (2, 2), (5, 2)), ("ngram",))
    path = write_policy(tmp_path / "p.yaml", policy, "e1", {"c_star": 5.7, "ci": [4.1, 7.9],
                                                            "where": "between"})
    text = path.read_text()
    assert text.startswith("# trtspec serve --policy FILE")
    assert read_policy(path) == policy
    body = yaml.safe_load(text)
    assert body["eval"] == "e1" and body["crossover"]["c_star"] == 5.7
    none = write_policy(tmp_path / "n.yaml", ServePolicy("none", ()), "e1")
    assert read_policy(none) == ServePolicy("none", ())


@pytest.mark.parametrize("text", ["[1, 2]", "method: ngram\nschedule: [1, 2]\n",
                                  "method: ngram\nschedule: {1: -1}\n",
                                  "method: ngram\nschedule: {4: 2, 1: 4}\n",
                                  "method: ngram\n", ": : :"])
def test_malformed_policy(tmp_path: Path, text: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        read_policy(path)
    assert "\n" not in str(e.value)


def test_make_decision_writes_crossover_memory_and_schedules(tmp_path: Path) -> None:
    import shutil

    from test_decide import paired

    from trtspec.build.recipe import load_recipe
    from trtspec.report.decision import make_decision

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "e"
    out.mkdir()
    recipe = yaml.safe_load((root / "recipes" / "cpu-smollm2.yaml").read_text())
    recipe.setdefault("decide", {})["require_audit"] = False  # GO without an audit
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    rows = (paired("ngram/D4/c1", 0.050, 0.025, n=30) + paired("ngram/D4/c2", 0.050, 0.036, n=30)
            + paired("ngram/D4/c4", 0.050, 0.065, n=30))
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = root / "engines" / "cpu-smollm2" / "cpu" / "manifest.json"
    if manifest.is_file():
        shutil.copyfile(manifest, out / "manifest.json")
    else:  # what a CPU build records of where it ran
        (out / "manifest.json").write_text(json.dumps({"backend": "torch", "gpu": None}))
    _, decision = make_decision(out, load_recipe(out / "recipe.yaml"), rows)
    cross = decision["crossover"]
    assert cross["levels"] == [1, 2, 4]
    curve = cross["curves"][0]
    assert curve["where"] == "between" and 2 < curve["c_star"] < 4
    assert decision["schedules"] == ["trtspec-policy.yaml", "trtllm-speculative.yaml",
                                     "vllm-speculative.json", "vllm-speculative.md"]
    policy = read_policy(out / "schedules" / "trtspec-policy.yaml")
    assert policy.method == "ngram" and policy.schedule == ((1, 4), (2, 4))  # c* ≈ 2.8
    text = (out / "schedules" / "trtllm-speculative.yaml").read_text()
    trtllm = yaml.safe_load(text)
    # measured with the torch backend on a CPU: the file says so
    assert "# Measured on a CPU with trtspec's torch backend, not TensorRT-LLM" in text
    # the last GO level is 2: from 3 running requests on, D = 0 (1.2.1's lower bounds)
    assert trtllm["speculative_config"]["draft_len_schedule"] == {1: 4, 3: 0}
    vllm = json.loads((out / "schedules" / "vllm-speculative.json").read_text())
    assert vllm["method"] == "ngram" and vllm["num_speculative_tokens"] == 4
    text = (out / "report.md").read_text()
    assert "## Concurrency crossover" in text and "## Memory cost" in text
    assert "## Deployment schedules" in text
    assert "runs ngram, D by running requests 1: 4, 2: 4 (plain decoding above)" in text
    assert "Concurrency crossover" in (out / "report.html").read_text()
    json.loads((out / "decision.json").read_text())
