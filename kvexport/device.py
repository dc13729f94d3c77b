"""``python -m kvexport.device ARTIFACT --prompt TEXT``: generate on the machine that runs the artifact.

ARTIFACT is an artifact folder or an archive from ``kvexport pack``; every file is checked against
its sha256 in ``kvexport.json`` before anything loads. The generation is ``kvexport run``'s own
(``run_command``: same sampling, EOS and cache-length rules, same ``--json`` fields), but this
module imports neither transformers nor torch for an ONNX artifact (onnxruntime, numpy and
tokenizers only, jinja2 for ``--chat``), nor typer or rich; a ``.pte`` needs ExecuTorch's Python
runtime, which brings torch.

``--runner executorch`` runs a ``.pte`` with ExecuTorch's own C++ LLM runner (``TextLLMRunner``,
in its pip package) instead: it samples, stops at EOS and prints the text itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import logs
from .errors import InvalidOptionError, KvexportError
from .artifact.archive import open_artifact
from .runtime.generation import check_fits
from .runtime.run import run_command
from .runtime.tokenizer import ArtifactTokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvexport.device",
        description="Generate with a kvexport artifact (folder or kvexport pack archive), without transformers.",
    )
    parser.add_argument("artifact", type=Path, help="artifact folder, or .tar from kvexport pack")
    parser.add_argument("--prompt", "-p", required=True, help="prompt text")
    parser.add_argument("--max-new-tokens", type=int, help="new tokens [default: until EOS or the cache is full]")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy [default: 0]")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold [default: 1]")
    parser.add_argument("--seed", type=int, help="sampling seed")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (float16 ONNX artifacts) [default: cpu]")
    parser.add_argument("--runner", choices=("kvexport", "executorch"), default="kvexport",
                        help="executorch: ExecuTorch's own TextLLMRunner (.pte only) [default: kvexport]")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return parser.parse_args(argv)


def run_with_executorch_runner(folder: Path, manifest: dict, args: argparse.Namespace) -> None:
    """Generate with ExecuTorch's stock ``TextLLMRunner``: what an app that embeds ExecuTorch's LLM
    runner does with this ``.pte``. It prints the text and a stats line on stdout itself."""
    if manifest["target"] != "executorch":
        raise InvalidOptionError(f"--runner executorch runs .pte artifacts; this one is {manifest['target']}")
    unsupported = {"--chat": args.chat, "--ignore-eos": args.ignore_eos, "--top-p": args.top_p != 1.0,
                   "--seed": args.seed is not None, "--device": args.device != "cpu", "--json": args.json}
    if any(unsupported.values()):
        flags = ", ".join(flag for flag, given in unsupported.items() if given)
        raise InvalidOptionError(f"ExecuTorch's runner has no {flags}; use the default --runner kvexport for them")
    prompt_ids = ArtifactTokenizer(folder).encode(args.prompt) if args.prompt else []
    check_fits(len(prompt_ids), args.max_new_tokens, manifest["max_cache_len"])
    try:
        from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    except ModuleNotFoundError as e:
        version = manifest.get("versions", {}).get("executorch")
        raise KvexportError(f"--runner executorch needs executorch ({e.name} is not installed): "
                            f"pip install executorch{'==' + version if version else ''}")
    from .runtime.executorch_program import register_kernels

    register_kernels()
    weights = str(folder / manifest["weights"]) if manifest.get("weights") else None
    # Its tokenizer adds no BOS: the runner prepends num_bos of them itself.
    bos = 1 if manifest.get("tokenizer_adds_bos") else 0
    config = GenerationConfig(
        max_new_tokens=-1 if args.max_new_tokens is None else args.max_new_tokens,  # -1: until the cache is full
        temperature=args.temperature, echo=False, num_bos=bos, num_eos=0,
    )
    try:  # it raises a bare RuntimeError for anything it cannot load or run
        TextLLMRunner(str(folder / manifest["program"]), str(folder / "tokenizer.json"), weights).generate(args.prompt, config)
    except RuntimeError as e:
        raise KvexportError(f"ExecuTorch's runner failed on {folder}: {e}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs.quiet()
    try:
        with open_artifact(args.artifact) as (folder, manifest):
            if args.runner == "executorch":
                run_with_executorch_runner(folder, manifest, args)
            else:
                run_command(
                    folder, args.prompt, args.max_new_tokens, args.ignore_eos, args.chat, args.temperature,
                    args.top_p, args.seed, args.device, args.json, manifest=manifest,
                )
    except KvexportError as e:
        print(f"kvexport: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("kvexport: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
