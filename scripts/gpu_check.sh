#!/bin/bash
# The real models on a GPU, as one prepared run (docs/development.md#on-a-gpu-machine):
#   bash scripts/gpu_check.sh OUT ARTIFACT=MODEL [ARTIFACT=MODEL ...]
# For each float16 or bfloat16 ONNX ARTIFACT: `kvexport check --device cuda` with kvexport's runner
# and with onnxruntime-genai's CUDA build, against eager transformers on MODEL (a GGUF, a folder);
# then `kvexport bench --device cuda`: eager in the artifact's dtype and both runners, on the GPU.
# Each step's output goes to OUT/NAME.out, its rc and time and the end of its stderr to OUT/log.txt.
# CHECK_ARGS (e.g. "--max-new-tokens 256") and PROMPT_TOKENS (default 128,1024) change the steps.
set -u
out=$1
shift
mkdir -p "$out"
kvexport="${PYTHON:-python3} -m kvexport.cli"

step() {
    local name=$1 start=$SECONDS
    shift
    timeout "${STEP_TIMEOUT:-300}" "$@" > "$out/$name.out" 2> "$out/$name.err"
    echo "$name rc=$? $((SECONDS - start))s" | tee -a "$out/log.txt"
    grep -v "it/s\]\|s/it\]" "$out/$name.err" | tail -3 >> "$out/log.txt"
}

for pair in "$@"; do
    artifact=${pair%%=*}
    model=${pair#*=}
    name=$(basename "$artifact")
    # shellcheck disable=SC2086  # CHECK_ARGS holds several words
    step "$name-check-kvexport" $kvexport check "$artifact" --device cuda --model "$model" --json ${CHECK_ARGS:-}
    # shellcheck disable=SC2086
    step "$name-check-genai" $kvexport check "$artifact" --device cuda --model "$model" --runner genai --json ${CHECK_ARGS:-}
    step "$name-bench" $kvexport bench "$model" "$artifact" --device cuda --paths eager,run,genai \
        --prompt-tokens "${PROMPT_TOKENS:-128,1024}" --new-tokens 128 --repeats 1 --json "$out/$name-bench.json"
done
