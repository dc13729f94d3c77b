"""Two exports of the same model with the same options are byte-identical, file by file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kvexport
from kvexport.exporter.artifact import sha256_file

REPO = Path(kvexport.__file__).resolve().parent.parent


def file_sums(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir())}


def test_reexporting_from_the_recorded_options_gives_identical_bytes(artifact, tmp_path):
    first = artifact("tiny-gemma3")  # exported in this process
    options = json.loads((first / "kvexport.json").read_text())["export_options"]
    assert options == {"model": "tiny-gemma3", "target": "executorch", "dtype": "float32", "max_cache_len": 64}

    # Again from what kvexport.json records, in another process (another hash seed, a fresh
    # import of everything) and to another folder.
    again = tmp_path / "elsewhere"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "kvexport.cli", "export", options["model"], "--target", options["target"]]
    command += ["--dtype", options["dtype"], "--max-cache-len", str(options["max_cache_len"]), "-o", str(again), "-q"]
    subprocess.run(command, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)

    sums = file_sums(again)
    assert {"model.pte", "model.ptd", "kvexport.json", "tokenizer.json"} <= set(sums)
    assert sums == file_sums(first)
