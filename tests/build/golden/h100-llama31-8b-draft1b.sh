#!/usr/bin/env bash
# trtspec build plan: h100-llama31-8b-draft1b for H100 (SM90)
# backend trtllm, workflow engine
# draft lengths: [2, 4, 7, 15, 31]
# D₀: G = num_attention_heads / num_key_value_heads = 32 / 8 = 4; D₀ = 128/G − 1 = 32 − 1 = 31
# note: convert_checkpoint.py reads local directories: fetch meta-llama/Llama-3.1-8B-Instruct, meta-llama/Llama-3.2-1B-Instruct first (`hf download ID --local-dir DIR`) and point the recipe at DIR (--set target.model=DIR)
set -euo pipefail
: "${TRTLLM_EXAMPLES:?set it to TensorRT-LLM's examples/ directory}"

# [1/5] convert target
python $TRTLLM_EXAMPLES/models/core/llama/convert_checkpoint.py --model_dir meta-llama/Llama-3.1-8B-Instruct --output_dir engines/h100-llama31-8b-draft1b/h100/checkpoints/target --dtype bfloat16 --tp_size 1 --pp_size 1

# [2/5] build target: the baseline engine (no speculation)
trtllm-build --checkpoint_dir engines/h100-llama31-8b-draft1b/h100/checkpoints/target --output_dir engines/h100-llama31-8b-draft1b/h100/engines/target --max_batch_size 64 --max_input_len 8192 --max_seq_len 10240 --max_num_tokens 16384 --gemm_plugin bfloat16 --gpt_attention_plugin bfloat16

# [3/5] build target-spec: verifies external drafts; runtime needs kv_cache_enable_block_reuse
trtllm-build --checkpoint_dir engines/h100-llama31-8b-draft1b/h100/checkpoints/target --output_dir engines/h100-llama31-8b-draft1b/h100/engines/target-spec --max_batch_size 64 --max_input_len 8192 --max_seq_len 10240 --max_num_tokens 16384 --gemm_plugin bfloat16 --gpt_attention_plugin bfloat16 --speculative_decoding_mode draft_tokens_external --max_draft_len 31 --use_paged_context_fmha enable --gather_generation_logits

# [4/5] convert draft
python $TRTLLM_EXAMPLES/models/core/llama/convert_checkpoint.py --model_dir meta-llama/Llama-3.2-1B-Instruct --output_dir engines/h100-llama31-8b-draft1b/h100/checkpoints/draft --dtype bfloat16 --tp_size 1 --pp_size 1

# [5/5] build draft: draft logits are passed to the target for exact sampling
trtllm-build --checkpoint_dir engines/h100-llama31-8b-draft1b/h100/checkpoints/draft --output_dir engines/h100-llama31-8b-draft1b/h100/engines/draft --max_batch_size 64 --max_input_len 8192 --max_seq_len 10240 --max_num_tokens 16384 --gemm_plugin bfloat16 --gpt_attention_plugin bfloat16 --gather_generation_logits

# next: run what this plan built (not run by this script)
# serve the baseline engine with TensorRT-LLM's trtllm-serve
#   trtllm-serve engines/h100-llama31-8b-draft1b/h100/engines/target --tokenizer meta-llama/Llama-3.1-8B-Instruct --backend tensorrt --tp_size 1 --pp_size 1 --port 8000
# engines/target-spec verifies drafts that a client passes with each request
# (draft_tokens_external); trtllm-serve passes none, so served alone it does not speculate, and
# trtspec has no such client yet: to measure draft_model / ngram through a server, plan the
# pytorch workflow (its trtllm-serve drafts itself)
#   trtspec build recipes/h100-llama31-8b-draft1b.yaml --set backend.workflow=pytorch
