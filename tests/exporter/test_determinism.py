"""An export by the CLI from the options another export recorded, in a process with another hash seed,
is byte-identical to it, file by file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kvexport
from kvexport.artifact.manifest import sha256_file

REPO = Path(kvexport.__file__).resolve().parent.parent


def file_sums(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir())}


def start_export(options: dict, out: Path, hash_seed: str) -> subprocess.Popen:
    """``kvexport export`` as a user runs it, from a process started with ``hash_seed``."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "kvexport.cli", "export", options["model"], "--target", options["target"]]
    command += ["--dtype", options["dtype"], "--max-cache-len", str(options["max_cache_len"])]
    command += ["--prefill-chunk", str(options["prefill_chunk"]), "-o", str(out), "-q"]
    for chosen in ("sdpa_query", "int8_kv_sdpa"):  # what auto chose where the artifact was exported
        if chosen in options:
            command += ["--" + chosen.replace("_", "-"), options[chosen]]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)


def test_reexporting_from_the_recorded_options_gives_identical_bytes(artifact, tmp_path):
    """Gemma 3 is the hard case: transformers computes its rotary tables in the order of a set of
    strings, which follows the process's hash seed (the CLI pins it for exports)."""
    exported = artifact("tiny-gemma3")  # by the Python API in this process (or by CI's matrix run)
    options = json.loads((exported / "kvexport.json").read_text())["export_options"]
    assert options["sdpa_query"] in ("grouped", "per-head")  # what --sdpa-query auto chose, timed where it ran
    assert {k: v for k, v in options.items() if k != "sdpa_query"} == {
        "model": "tiny-gemma3", "target": "executorch", "dtype": "float32", "max_cache_len": 64, "prefill_chunk": 64}

    # From what kvexport.json records, to another folder, by the CLI from a process started with
    # another hash seed (a fresh import of everything).
    again = tmp_path / "elsewhere" / "again"
    assert start_export(options, again, hash_seed="1").wait(timeout=600) == 0
    assert {"model.pte", "model.ptd", "kvexport.json", "tokenizer.json"} <= set(file_sums(again))
    assert file_sums(again) == file_sums(exported)
