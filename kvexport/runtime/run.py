"""``kvexport run`` and ``python -m kvexport.device``: generate from a prompt with the artifact and
its tokenizer only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..artifact.archive import open_artifact
from ..artifact.manifest import read_manifest
from .generation import Sampling, check_fits, generate
from .options import parse_run_args
from .programs import load_program
from .tokenizer import ArtifactTokenizer


class TextStream:
    """Prints text as tokens arrive, decoding the whole tail so multi-byte characters come out whole."""

    def __init__(self, tokenizer: ArtifactTokenizer, out=None):
        # sys.stdout when called, not when imported: it may have been replaced since (tests, embedders).
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.ids: list[int] = []
        self.printed = ""

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text


def run_command(
    folder, prompt, max_new_tokens, ignore_eos, chat, temperature, top_p, seed, device, as_json, manifest=None
) -> dict:
    """``kvexport run`` and ``python -m kvexport.device``. ``manifest``: already read and verified."""
    folder = Path(folder)
    manifest = manifest or read_manifest(folder)
    tokenizer = ArtifactTokenizer(folder)
    if chat:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
    else:
        prompt_ids = tokenizer.encode(prompt) if prompt else []
    check_fits(len(prompt_ids), max_new_tokens, manifest["max_cache_len"])
    sampling = Sampling(temperature, top_p, seed)
    program = load_program(folder, manifest, device)
    stream = None if as_json else TextStream(tokenizer)
    eos = set() if ignore_eos else set(manifest["eos_token_ids"])
    if chat and not ignore_eos:  # a reply ends at the template's end of turn (Gemma: <end_of_turn>, not <eos>)
        eos |= set(tokenizer.turn_end_ids())
    result = generate(program, prompt_ids, max_new_tokens, eos, sampling, on_token=stream)
    summary = {
        "prompt_ids": result.prompt_ids,
        "new_ids": result.new_ids,
        "text": tokenizer.decode(result.new_ids),
        "stopped_by": result.stopped_by,
        "prefill_tokens_per_s": round(result.prefill_tokens_per_s, 2),
        "decode_tokens_per_s": round(result.decode_tokens_per_s, 2),
    }
    if as_json:
        print(json.dumps(summary))
    else:
        print()
        note = ""
        if result.stopped_by == "max_cache_len":
            note = f"; stopped: the cache is full ({manifest['max_cache_len']} positions)"
        print(
            f"[{len(result.prompt_ids)} prompt tokens, {len(result.new_ids)} new; "
            f"prefill {summary['prefill_tokens_per_s']} tok/s, decode {summary['decode_tokens_per_s']} tok/s{note}]",
            file=sys.stderr,
        )
    return summary


def run_main(argv: list[str], prog: str) -> dict | None:
    """Parse ``argv`` as ``prog`` (``kvexport run`` or the device runner) and generate."""
    args = parse_run_args(argv, prog)
    with open_artifact(args.artifact) as (folder, manifest):
        if args.runner == "executorch":
            from .textllm import run_with_textllm_runner

            run_with_textllm_runner(folder, manifest, args)
            return None
        return run_command(folder, args.prompt, args.max_new_tokens, args.ignore_eos, args.chat, args.temperature,
                           args.top_p, args.seed, args.device, args.json, manifest=manifest)
