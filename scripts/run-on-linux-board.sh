#!/usr/bin/env bash
# Generate with a kvexport artifact on a Linux board (Raspberry Pi, Jetson, ...) over ssh.
#
# usage: scripts/run-on-linux-board.sh ARCHIVE USER@HOST [python -m kvexport.device options]
#   kvexport pack build/gemma3-270m-onnx               # -> build/gemma3-270m-onnx.tar
#   scripts/run-on-linux-board.sh build/gemma3-270m-onnx.tar pi@board --prompt "The capital of France is" --max-new-tokens 32
#
# It copies kvexport's Python code and the archive to ~/$REMOTE_DIR (default kvexport-device) on
# the board (the archive only when the board's copy differs, checked by sha256), unpacks it there
# once, and runs `python3 -m kvexport.device FOLDER OPTIONS`, which checks every file against
# kvexport.json before loading. Nothing is installed system-wide.
#
# The board needs python3 >= 3.10 and the artifact's runtime (the versions are in kvexport.json):
#   ONNX artifact:  pip install onnxruntime numpy tokenizers jinja2    (no torch, no transformers)
#   .pte artifact:  pip install executorch tokenizers jinja2           (ExecuTorch's runtime brings torch)
set -euo pipefail
if [ $# -lt 2 ]; then sed -n '2,17p' "$0"; exit 2; fi
archive=$1 host=$2
shift 2
remote_dir=${REMOTE_DIR:-kvexport-device}
repo=$(cd "$(dirname "$0")/.." && pwd)
name=$(basename "$archive")
folder=$(tar -tf "$archive" | sed -n '1s|/.*||p')  # kvexport pack puts everything under one folder
sum=$(sha256sum "$archive" | cut -d' ' -f1)

ssh "$host" "mkdir -p $remote_dir"
tar -C "$repo" --exclude=__pycache__ -cf - kvexport | ssh "$host" "cd $remote_dir && rm -rf kvexport && tar -xf -"
if ! ssh "$host" "cd $remote_dir && echo '$sum  $name' | sha256sum -c --status 2>/dev/null"; then
    scp "$archive" "$host:$remote_dir/$name"
    ssh "$host" "cd $remote_dir && echo '$sum  $name' | sha256sum -c --quiet && rm -rf '$folder' && tar -xf '$name'"
fi
# -t: a terminal, so the reply streams and Ctrl-C reaches the runner.
ssh -t "$host" "cd $remote_dir && python3 -m kvexport.device $(printf '%q ' "$folder" "$@")"
