"""TensorRT-LLM's ``speculative_config`` field names per release, with where they were read:
what every options file and schedule trtspec writes is checked against (the stand-in in
tests/standin/ enforces the 1.2.1 lists too)."""

from __future__ import annotations

# tensorrt_llm/llmapi/llm_args.py of the 1.2 line (main as release/1.2 branched from it,
# 1.2.0rc7–rc8: DecodingBaseConfig and its subclasses; the v1.2.1 tag itself could not be
# read here). draft_len_schedule keys are lower bounds; no use_rejection_sampling.
BASE_12 = {"decoding_type", "max_draft_len", "max_total_draft_tokens", "speculative_model",
           "speculative_model_dir", "max_concurrency", "draft_len_schedule", "load_format",
           "acceptance_window", "acceptance_length_threshold", "allow_advanced_sampling"}
EAGLE_12 = {"eagle_choices", "greedy_sampling", "posterior_threshold", "use_dynamic_tree",
            "dynamic_tree_max_topK", "num_eagle_layers", "max_non_leaves_per_layer",
            "eagle3_one_model", "eagle3_layers_to_capture", "eagle3_model_arch"}
RELEASE_12 = {
    "Draft_Target": BASE_12,
    "NGram": BASE_12 | {"max_matching_ngram_size", "is_keep_all", "is_use_oldest",
                        "is_public_pool"},
    "Eagle": BASE_12 | EAGLE_12,
    "Eagle3": BASE_12 | EAGLE_12,
    "MTP": BASE_12 | {"num_nextn_predict_layers", "use_relaxed_acceptance_for_thinking",
                      "relaxed_topk", "relaxed_delta", "use_mtp_vanilla", "mtp_eagle_one_model",
                      "begin_thinking_phase_token", "end_thinking_phase_token"},
    "Medusa": BASE_12 | {"medusa_choices", "num_medusa_heads"},
}
# The same file on main after PR #10860 (1.3 release candidates): DraftTarget replaces
# Draft_Target, no Medusa or EAGLE-1/2 on the PyTorch workflow, draft_len_schedule keys are
# upper bounds (exclusive with max_concurrency), use_rejection_sampling (prototype) added,
# allow_advanced_sampling kept as a deprecated no-op.
BASE_13 = BASE_12 | {"use_rejection_sampling"}
RELEASE_13 = {"DraftTarget": BASE_13, "NGram": RELEASE_12["NGram"] | BASE_13,
              "Eagle3": BASE_13 | EAGLE_12, "MTP": RELEASE_12["MTP"] | BASE_13}
FIELDS = {"1.2.1": RELEASE_12, "1.3.0rc1": RELEASE_13}


def check_config(config: dict, release: str) -> None:
    """AssertionError unless ``config`` uses only ``release``'s decoding types and fields."""
    types = FIELDS[release]
    assert config["decoding_type"] in types, (release, config["decoding_type"])
    extra = set(config) - types[config["decoding_type"]]
    assert not extra, (release, extra)
