#!/usr/bin/env bash
# Generate with a kvexport ExecuTorch artifact (.pte) on an Android device over adb.
#
# usage: scripts/run-on-android.sh ARCHIVE LLAMA_MAIN PROMPT [SEQ_LEN]
#   kvexport pack build/gemma3-270m-executorch
#   scripts/run-on-android.sh build/gemma3-270m-executorch.tar path/to/llama_main "The capital of France is" 64
#
# Android has no Python, so `python -m kvexport.device` does not run there; an ONNX artifact needs
# an app built on ONNX Runtime's Android library. A .pte runs in ExecuTorch's own C++ LLM runner,
# the one apps embed through ExecuTorch's Android library (LlmModule: model.pte, tokenizer.json,
# model.ptd). This script uses its command-line form, LLAMA_MAIN: ExecuTorch's
# examples/models/llama runner built for arm64-v8a with the Android NDK, with the XNNPACK backend
# and the LLM custom ops (llama::update_cache, llama::custom_sdpa) linked in, as ExecuTorch's
# "Llama on Android" guide builds it; build it from the ExecuTorch release in kvexport.json
# (versions.executorch). Flags are those of that runner (check `llama_main --help` for yours).
#
# The device needs only adb access (USB debugging); files go to /data/local/tmp/kvexport.
set -euo pipefail
if [ $# -lt 3 ]; then sed -n '2,20p' "$0"; exit 2; fi
archive=$1 llama_main=$2 prompt=$3 seq_len=${4:-128}
dir=/data/local/tmp/kvexport
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

tar -C "$work" -xf "$archive"  # unpacked here: Android's own tar cannot be relied on
folder=$(ls "$work")
manifest="$work/$folder/kvexport.json"
# The manifest is the one packed (artifacts exported before kvexport.json.sha256 existed have none).
(cd "$work/$folder" && { [ ! -f kvexport.json.sha256 ] || sha256sum -c --quiet kvexport.json.sha256; })
read -r target num_bos < <(python3 -c 'import json, sys; m = json.load(open(sys.argv[1]))
print(m["target"], 1 if m["tokenizer_adds_bos"] else 0)' "$manifest")
[ "$target" = executorch ] || { echo "$archive is a $target artifact; this script runs .pte artifacts" >&2; exit 2; }

adb shell "rm -rf $dir/$folder && mkdir -p $dir/$folder"
adb push "$llama_main" "$dir/llama_main" >/dev/null
adb shell chmod 755 "$dir/llama_main"
for file in model.pte model.ptd tokenizer.json; do
    adb push "$work/$folder/$file" "$dir/$folder/$file" >/dev/null
    # The copy on the device against the sum kvexport.json gives (the runner itself checks nothing).
    want=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["files"][sys.argv[2]]["sha256"])' "$manifest" "$file")
    got=$(adb shell sha256sum "$dir/$folder/$file" | cut -d' ' -f1)
    [ "$got" = "$want" ] || { echo "$file was corrupted on the way to the device" >&2; exit 1; }
done

# The runner's tokenizer adds no BOS: --num_bos adds it where the model wants one (kvexport.json).
quoted=$(printf "%s" "$prompt" | sed "s/'/'\\\\''/g")
adb shell "cd $dir/$folder && $dir/llama_main --model_path=model.pte --data_path=model.ptd \
    --tokenizer_path=tokenizer.json --prompt='$quoted' --temperature=0 --seq_len=$seq_len --num_bos=$num_bos"
