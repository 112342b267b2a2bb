#!/usr/bin/env bash
# trtspec build plan: h200-llama31-8b-eagle3 for H200 (SM90)
# backend trtllm, workflow pytorch
# draft lengths: [2, 3, 4, 6]
# D₀: G = num_attention_heads / num_key_value_heads = 32 / 8 = 4; D₀ = 128/G − 1 = 32 − 1 = 31
set -euo pipefail

# [1/5] write baseline
mkdir -p engines/h200-llama31-8b-eagle3/h200/llmapi
cat > engines/h200-llama31-8b-eagle3/h200/llmapi/baseline.yaml <<'YAML'
max_batch_size: 64
max_num_tokens: 8192
max_seq_len: 10240
YAML

# [2/5] write eagle-d2
mkdir -p engines/h200-llama31-8b-eagle3/h200/llmapi
cat > engines/h200-llama31-8b-eagle3/h200/llmapi/eagle-d2.yaml <<'YAML'
max_batch_size: 64
max_num_tokens: 8192
max_seq_len: 10240
speculative_config:
  decoding_type: Eagle3
  max_draft_len: 2
  speculative_model: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
YAML

# [3/5] write eagle-d3
mkdir -p engines/h200-llama31-8b-eagle3/h200/llmapi
cat > engines/h200-llama31-8b-eagle3/h200/llmapi/eagle-d3.yaml <<'YAML'
max_batch_size: 64
max_num_tokens: 8192
max_seq_len: 10240
speculative_config:
  decoding_type: Eagle3
  max_draft_len: 3
  speculative_model: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
YAML

# [4/5] write eagle-d4
mkdir -p engines/h200-llama31-8b-eagle3/h200/llmapi
cat > engines/h200-llama31-8b-eagle3/h200/llmapi/eagle-d4.yaml <<'YAML'
max_batch_size: 64
max_num_tokens: 8192
max_seq_len: 10240
speculative_config:
  decoding_type: Eagle3
  max_draft_len: 4
  speculative_model: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
YAML

# [5/5] write eagle-d6
mkdir -p engines/h200-llama31-8b-eagle3/h200/llmapi
cat > engines/h200-llama31-8b-eagle3/h200/llmapi/eagle-d6.yaml <<'YAML'
max_batch_size: 64
max_num_tokens: 8192
max_seq_len: 10240
speculative_config:
  decoding_type: Eagle3
  max_draft_len: 6
  speculative_model: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
YAML

# next: run what this plan built (not run by this script)
# serve one speculative condition (one server per method × D: swap the YAML) and the baseline with
# TensorRT-LLM's trtllm-serve
#   trtllm-serve meta-llama/Llama-3.1-8B-Instruct --tp_size 1 --pp_size 1 --extra_llm_api_options engines/h200-llama31-8b-eagle3/h200/llmapi/eagle-d2.yaml --port 8001
#   trtllm-serve meta-llama/Llama-3.1-8B-Instruct --tp_size 1 --pp_size 1 --extra_llm_api_options engines/h200-llama31-8b-eagle3/h200/llmapi/baseline.yaml --port 8000
# both servers up: the recipe's workloads, sampling and concurrency against them
#   trtspec eval recipes/h200-llama31-8b-eagle3.yaml --endpoint http://127.0.0.1:8001/v1 --model meta-llama/Llama-3.1-8B-Instruct --baseline-endpoint http://127.0.0.1:8000/v1
# go / no-go
#   trtspec decide reports/<eval-id>
