"""``kvexport run`` and ``python -m kvexport.device``: generate from a prompt with the artifact and
its tokenizer only."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from ..artifact.archive import open_artifact
from ..artifact.manifest import Manifest
from ..errors import InvalidOptionError
from ..logs import VERBOSE_ENV
from .generation import Generation, Sampling, check_fits, generate
from .options import parse_run_args
from .programs import load_program
from .speculation import SpeculativeGeneration, generate_with_draft, load_drafter
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


def encode_prompt(tokenizer: ArtifactTokenizer, prompt: str, chat: bool = False) -> list[int]:
    """The prompt's ids; with ``chat``, wrapped in the model's chat template as one user turn."""
    if chat:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt) if prompt else []


def generate_text(program, tokenizer: ArtifactTokenizer, prompt_ids: list[int], max_new_tokens: int | None = None,
                  ignore_eos: bool = False, chat: bool = False, sampling: Sampling | None = None,
                  on_token=None, drafter=None, draft_tokens: int | None = None) -> Generation:
    """Generate from ``prompt_ids`` until EOS (and, with ``chat``, the template's end of turn), and
    decode the new tokens; with a ``drafter``, speculatively (``speculation``), ``draft_tokens`` at
    a time (default: the artifact's most)."""
    eos = set() if ignore_eos else set(program.manifest.eos_token_ids)
    if chat and not ignore_eos:  # a reply ends at the template's end of turn (Gemma: <end_of_turn>, not <eos>)
        eos |= set(tokenizer.turn_end_ids())
    if drafter is not None:
        result = generate_with_draft(program, prompt_ids, max_new_tokens, drafter, draft_tokens, eos, on_token=on_token)
    else:
        result = generate(program, prompt_ids, max_new_tokens, eos, sampling or Sampling(), on_token=on_token)
    result.text = tokenizer.decode(result.new_ids)
    return result


def run_command(folder: Path, manifest: Manifest, args: argparse.Namespace, sampling: Sampling) -> dict:
    """``kvexport run`` and ``python -m kvexport.device`` (``run_main``) with kvexport's own loop, on
    kvexport's runner or onnxruntime-genai's."""
    tokenizer = ArtifactTokenizer(folder, manifest)
    prompt_ids = encode_prompt(tokenizer, args.prompt, args.chat)
    check_fits(len(prompt_ids), args.max_new_tokens, manifest.max_cache_len)  # before the program loads
    program = load_program(folder, manifest, args.device, args.runner)
    stream = None if args.json else TextStream(tokenizer)
    with contextlib.ExitStack() as stack:
        drafter = load_drafter(args.draft, stack, args.device) if args.draft else None
        result = generate_text(program, tokenizer, prompt_ids, args.max_new_tokens, args.ignore_eos, args.chat, sampling,
                               on_token=stream, drafter=drafter, draft_tokens=args.draft_tokens)
    summary = {
        "prompt_ids": result.prompt_ids,
        "new_ids": result.new_ids,
        "text": result.text,
        "stopped_by": result.stopped_by,
        "prefill_tokens_per_s": round(result.prefill_tokens_per_s, 2),
        "decode_tokens_per_s": round(result.decode_tokens_per_s, 2),
        **({"speculation": result.speculation.summary()} if isinstance(result, SpeculativeGeneration) else {}),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print()
        note = ""
        if "speculation" in summary:
            spec = summary["speculation"]
            note += f"; {spec['accepted']}/{spec['drafted']} drafted tokens accepted in {spec['verify_calls']} verifications"
        if result.stopped_by == "max_cache_len":
            note += f"; stopped: the cache is full ({manifest.max_cache_len} positions)"
        print(
            f"[{len(result.prompt_ids)} prompt tokens, {len(result.new_ids)} new; "
            f"prefill {summary['prefill_tokens_per_s']} tok/s, decode {summary['decode_tokens_per_s']} tok/s{note}]",
            file=sys.stderr,
        )
    return summary


def run_main(argv: list[str], prog: str) -> dict | None:
    """Parse ``argv`` as ``prog`` (``kvexport run`` or the device runner) and generate."""
    args = parse_run_args(argv, prog)
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"
    sampling = Sampling(args.temperature, args.top_p, args.seed)  # checked before anything loads
    if args.draft and (args.temperature or args.runner != "kvexport"):
        raise InvalidOptionError("--draft decodes greedily with kvexport's runner: leave out --temperature and --runner")
    with open_artifact(args.artifact) as (folder, manifest):
        if args.runner == "executorch":
            from .textllm import run_with_textllm_runner

            run_with_textllm_runner(folder, manifest, args)
            return None
        return run_command(folder, manifest, args, sampling)
