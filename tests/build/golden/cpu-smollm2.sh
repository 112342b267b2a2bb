#!/usr/bin/env bash
# trtspec build plan: cpu-smollm2 for this machine's CPU/GPU
# backend torch
# draft lengths: [2, 4]
# D₀: G = num_attention_heads / num_key_value_heads = 9 / 3 = 3; D₀ = 128/G − 1 = 42 − 1 = 41
set -euo pipefail

# [1/5] target
# resolve smollm2-135m-instruct (a GGUF is converted once to safetensors and cached); record config/tokenizer digests

# [2/5] layer_skip-24
# check the target has more than 24 layers (the draft shares its weights)

# [3/5] eagle
# load the eagle heads in heads/smollm2-135m-eagle3 against the target (shapes, vocabulary); left out, with how to train them, when the folder is missing

# [4/5] compile target
# torch.compile one decoder layer of the target (for one row and for several), kernels cached in inductor/ here

# [5/5] cost curve
# time the target scoring T = 1 … 9 new tokens in a row, and each draft's one step (fastest of five, into the manifest): the costs of the adaptive draft length

# next: run what this plan built (not run by this script)
# baseline vs speculative on these models, in-process; it prints reports/<eval-id>
#   trtspec eval recipes/cpu-smollm2.yaml
# is speculative sampling exact on these models?
#   trtspec audit reports/<eval-id>
# go / no-go per condition (with the audit)
#   trtspec decide reports/<eval-id>
