#!/usr/bin/env bash
# trtspec build plan: a100-vicuna7b-medusa for A100-80GB (SM80)
# backend trtllm, workflow engine
# draft lengths: [4, 8, 16]
# D₀: G = num_attention_heads / num_key_value_heads = 32 / 32 = 1; D₀ = 128/G − 1 = 128 − 1 = 127, clamped to 63
# note: convert_checkpoint.py reads local directories: fetch lmsys/vicuna-7b-v1.3, FasterDecoding/medusa-vicuna-7b-v1.3 first (`hf download ID --local-dir DIR`) and point the recipe at DIR (--set target.model=DIR)
set -euo pipefail
: "${TRTLLM_EXAMPLES:?set it to TensorRT-LLM's examples/ directory}"

# [1/4] convert target
python $TRTLLM_EXAMPLES/models/core/llama/convert_checkpoint.py --model_dir lmsys/vicuna-7b-v1.3 --output_dir engines/a100-vicuna7b-medusa/a100-80gb/checkpoints/target --dtype float16 --tp_size 1 --pp_size 1

# [2/4] build target: the baseline engine (no speculation)
trtllm-build --checkpoint_dir engines/a100-vicuna7b-medusa/a100-80gb/checkpoints/target --output_dir engines/a100-vicuna7b-medusa/a100-80gb/engines/target --max_batch_size 8 --max_input_len 1024 --max_seq_len 2048 --max_num_tokens 4096 --gemm_plugin float16 --gpt_attention_plugin float16

# [3/4] convert medusa
python $TRTLLM_EXAMPLES/medusa/convert_checkpoint.py --model_dir lmsys/vicuna-7b-v1.3 --medusa_model_dir FasterDecoding/medusa-vicuna-7b-v1.3 --num_medusa_heads 4 --output_dir engines/a100-vicuna7b-medusa/a100-80gb/checkpoints/medusa --dtype float16 --tp_size 1 --pp_size 1

# [4/4] build medusa: Medusa verifies by token matching (exact only at temperature 0)
trtllm-build --checkpoint_dir engines/a100-vicuna7b-medusa/a100-80gb/checkpoints/medusa --output_dir engines/a100-vicuna7b-medusa/a100-80gb/engines/medusa --max_batch_size 8 --max_input_len 1024 --max_seq_len 2048 --max_num_tokens 4096 --gemm_plugin float16 --gpt_attention_plugin float16 --speculative_decoding_mode medusa --max_draft_len 16

# next: run what this plan built (not run by this script)
# serve the baseline engine with TensorRT-LLM's trtllm-serve
#   trtllm-serve engines/a100-vicuna7b-medusa/a100-80gb/engines/target --tokenizer lmsys/vicuna-7b-v1.3 --backend tensorrt --tp_size 1 --pp_size 1 --port 8000
# and the medusa engine
#   trtllm-serve engines/a100-vicuna7b-medusa/a100-80gb/engines/medusa --tokenizer lmsys/vicuna-7b-v1.3 --backend tensorrt --tp_size 1 --pp_size 1 --port 8001
# both servers up: the recipe's workloads, sampling and concurrency against them
#   trtspec eval recipes/a100-vicuna7b-medusa.yaml --endpoint http://127.0.0.1:8001/v1 --model lmsys/vicuna-7b-v1.3 --baseline-endpoint http://127.0.0.1:8000/v1
# go / no-go
#   trtspec decide reports/<eval-id>
