"""ExecuTorch's own C++ LLM runner (``TextLLMRunner``, in its pip package) on a ``.pte``: what an app
that embeds it does. It samples, stops at EOS and prints the text itself."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..artifact.manifest import Manifest
from ..errors import InvalidOptionError, KvexportError
from ..logs import native_stderr_quiet
from .generation import check_fits
from .tokenizer import ArtifactTokenizer


def run_with_textllm_runner(folder: Path, manifest: Manifest, args: argparse.Namespace) -> None:
    """Generate with ExecuTorch's stock ``TextLLMRunner``: what an app that embeds ExecuTorch's LLM
    runner does with this ``.pte``. It prints the text and a stats line on stdout itself."""
    if manifest.target != "executorch":
        raise InvalidOptionError(f"--runner executorch runs .pte artifacts; this one is {manifest.target}")
    unsupported = {"--chat": args.chat, "--ignore-eos": args.ignore_eos, "--top-p": args.top_p != 1.0,
                   "--seed": args.seed is not None, "--device": args.device != "cpu", "--json": args.json}
    if any(unsupported.values()):
        flags = ", ".join(flag for flag, given in unsupported.items() if given)
        raise InvalidOptionError(f"ExecuTorch's runner has no {flags}; use the default --runner kvexport for them")
    prompt_ids = ArtifactTokenizer(folder).encode(args.prompt) if args.prompt else []
    check_fits(len(prompt_ids), args.max_new_tokens, manifest.max_cache_len)
    from .executorch_program import check_program_file, register_kernels, threads_as_asked

    try:
        register_kernels(manifest)
        with native_stderr_quiet():  # its tokenizer library logs at import
            from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    except ModuleNotFoundError as e:
        version = manifest.version("executorch")
        raise KvexportError(f"--runner executorch needs executorch ({e.name} is not installed): "
                            f"pip install executorch{'==' + version if version else ''}")
    threads_as_asked()
    check_program_file(folder / manifest.program, manifest)  # its runner trusts the .pte, check_fits the manifest
    weights = str(folder / manifest.weights) if manifest.weights else None
    # Its tokenizer adds no BOS: the runner prepends num_bos of them itself.
    bos = 1 if manifest.tokenizer_adds_bos else 0
    config = GenerationConfig(
        max_new_tokens=-1 if args.max_new_tokens is None else args.max_new_tokens,  # -1: until the cache is full
        temperature=args.temperature, echo=False, num_bos=bos, num_eos=0,
    )
    try:  # it raises a bare RuntimeError for anything it cannot load or run
        with native_stderr_quiet():  # its log lines; the text and stats go to stdout
            TextLLMRunner(str(folder / manifest.program), str(folder / "tokenizer.json"), weights).generate(args.prompt, config)
    except RuntimeError as e:
        raise KvexportError(f"ExecuTorch's runner failed on {folder}: {e}")
