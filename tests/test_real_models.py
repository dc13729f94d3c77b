"""The real models (Gemma 3 270M: 15 sliding layers of window 512; SmolLM2-135M), exported once per
target at max_cache_len 1024, with a verification of up to 8 drafted tokens (which leaves the
interface every runtime calls as it was), and compared with eager transformers far past the window,
speculative decoding included. Slow: minutes each."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import pytest

from kvexport.artifact.manifest import read_manifest
from kvexport.checker.check import smallest_window
from kvexport.cli import main
from kvexport.models import sources
from kvexport.runtime.tokenizer import ArtifactTokenizer

from tests.conftest import exported_once, shared_dir
from tests.helpers import eager_ids, genai_greedy, on_one_worker

pytestmark = pytest.mark.slow

SHORT_PROMPT = "The history of the city of Paris"
DRAFT_TOKENS = 8
PARAGRAPH = (
    "The river flows through the old town, past the market square and the cathedral, and on toward "
    "the sea. Merchants have traded along its banks for centuries, and the bridges that cross it "
    "were rebuilt many times after floods and wars. "
)


def export_real(tmp_path_factory, name: str, target: str) -> Path:
    """The real model exported for ``target`` at max_cache_len 1024, once per test run."""

    def export(folder: Path) -> None:
        with pytest.raises(SystemExit) as done:
            main(["export", name, "--target", target, "-o", str(folder), "--max-cache-len", "1024",
                  "--max-draft-tokens", str(DRAFT_TOKENS), "--quiet", "--force"])
        assert done.value.code == 0

    return exported_once(tmp_path_factory, f"real-{name}-{target}", export)


@functools.cache
def eager_model(name: str):
    return sources.load_model(sources.resolve(name))[0]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((name, target), id=f"{name}-{target}", marks=on_one_worker(f"real-{name}-{target}"))
        for target in ("executorch", "onnx") for name in ("gemma3-270m", "smollm2-135m")
    ],
)
def real(request, tmp_path_factory):
    """(folder, eager model) for one real model and target."""
    name, target = request.param
    return export_real(tmp_path_factory, name, target), eager_model(name)


@pytest.fixture(scope="session")
def reference_ids(tmp_path_factory):
    """``reference_ids(model, prompt_ids, n)``: eager greedy ids, generated once per test run for both
    targets (minutes on a CPU), whichever pytest-xdist worker asks first."""
    from filelock import FileLock

    folder = shared_dir(tmp_path_factory) / "eager-ids"
    folder.mkdir(parents=True, exist_ok=True)

    def get(model, prompt_ids: list[int], n: int) -> list[int]:
        key = hashlib.sha256(json.dumps([model.name_or_path, prompt_ids, n]).encode()).hexdigest()[:16]
        path = folder / f"{key}.json"
        with FileLock(str(path) + ".lock"):
            if not path.is_file():
                path.write_text(json.dumps(eager_ids(model, prompt_ids, n)))
            return json.loads(path.read_text())

    return get


def kvexport_run(capsys, folder, prompt, n, *options) -> dict:
    with pytest.raises(SystemExit) as done:
        main(["run", str(folder), "--prompt", prompt, "--max-new-tokens", str(n), "--ignore-eos", "--json", *options])
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    return json.loads(out)


def long_prompt(tokenizer: ArtifactTokenizer, tokens: int) -> str:
    text = ""
    while len(tokenizer.encode(text)) < tokens:
        text += PARAGRAPH
    return text


# New tokens after a prompt longer than the window: its prefill already wraps every ring; each step
# after it writes over the ring's oldest row, as the first does.
AFTER_LONG_PROMPT = 64


def long_generation(folder: Path) -> int:
    """New tokens after the short prompt: 64 past the smallest window (Gemma 3's 512), as `kvexport
    check`'s own first prompt; SmolLM2 has no window, and every step of its cache is the same code,
    so a shorter run proves as much for it."""
    window = smallest_window(read_manifest(folder))
    return window + 64 if window else 128


def test_a_long_generation_after_a_short_prompt_matches_eager(real, capsys, reference_ids):
    folder, model = real
    n = long_generation(folder)
    result = kvexport_run(capsys, folder, SHORT_PROMPT, n)
    assert result["new_ids"] == reference_ids(model, result["prompt_ids"], n)


def test_new_tokens_after_a_prompt_longer_than_the_window_match_eager(real, capsys, reference_ids):
    folder, model = real
    prompt = long_prompt(ArtifactTokenizer(folder), 800)
    result = kvexport_run(capsys, folder, prompt, AFTER_LONG_PROMPT)
    assert len(result["prompt_ids"]) > 512
    assert result["new_ids"] == reference_ids(model, result["prompt_ids"], AFTER_LONG_PROMPT)


def test_speculative_decoding_with_prompt_lookup_matches_eager_past_the_window(real, capsys, reference_ids):
    """Drafts from prompt lookup, verified 8 at a time, through the window's wrap: eager's tokens."""
    folder, model = real
    n = long_generation(folder)
    result = kvexport_run(capsys, folder, SHORT_PROMPT, n, "--draft", "ngram")
    assert result["new_ids"] == reference_ids(model, result["prompt_ids"], n)
    spec = result["speculation"]
    assert spec["verify_calls"] > 0 and spec["accepted"] > 0, spec


@pytest.mark.parametrize("prompt_tokens, n", [(None, None), (800, AFTER_LONG_PROMPT)], ids=["short-long-generation", "long-prompt"])
def test_onnx_in_onnxruntime_genai_matches_eager(real, reference_ids, prompt_tokens, n):
    """The ONNX folder as it is in onnxruntime-genai (og.Model, its own cache and greedy search):
    eager's ids after a short prompt and after one longer than the window."""
    folder, model = real
    if json.loads((folder / "kvexport.json").read_text())["target"] != "onnx":
        pytest.skip("onnxruntime-genai runs ONNX artifacts")
    n = n or long_generation(folder)
    tokenizer = ArtifactTokenizer(folder)
    prompt_ids = tokenizer.encode(long_prompt(tokenizer, prompt_tokens) if prompt_tokens else SHORT_PROMPT)
    assert genai_greedy(folder, prompt_ids, n) == reference_ids(model, prompt_ids, n)


def test_executorch_text_llm_runner_generates_eager_text(real, reference_ids):
    folder, model = real
    manifest = json.loads((folder / "kvexport.json").read_text())
    if manifest["target"] != "executorch":
        pytest.skip("ExecuTorch's own runner runs .pte artifacts only")
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    from kvexport.runtime.executorch_program import register_kernels

    register_kernels()
    tokenizer = ArtifactTokenizer(folder)
    prompt_ids = tokenizer.encode(SHORT_PROMPT)
    # The stock runner adds BOS itself (num_bos) and stops at EOS: give eager the same prompt and stop.
    bos = 1 if manifest["tokenizer_adds_bos"] else 0
    pieces: list[str] = []
    runner = TextLLMRunner(str(folder / "model.pte"), str(folder / "tokenizer.json"), str(folder / "model.ptd"))
    runner.generate(
        SHORT_PROMPT,
        GenerationConfig(max_new_tokens=48, temperature=0.0, echo=False, num_bos=bos, num_eos=0),
        token_callback=pieces.append,
    )
    expected = reference_ids(model, prompt_ids, long_generation(folder))[:48]  # greedy: a prefix of the long run
    stop = next((i for i, t in enumerate(expected) if t in manifest["eos_token_ids"]), len(expected))
    assert "".join(pieces).strip() == tokenizer.decode(expected[:stop]).strip()


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_prompt_ids_are_transformers_ids(real):
    """Both real models chat (Gemma 3 270M with the template the export adds), with transformers' ids."""
    from transformers import AutoTokenizer

    folder, _ = real
    expected = AutoTokenizer.from_pretrained(folder).apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    assert ArtifactTokenizer(folder).encode_chat(CHAT) == expected["input_ids"]


def test_the_device_runner_generates_eager_s_tokens(real, reference_ids):
    """python -m kvexport.device on the real folder: ONNX with only onnxruntime, numpy, tokenizers;
    a .pte without transformers. Greedy ids are a prefix of a longer greedy run's: the reference is
    the long generation's, made once per run."""
    from tests.test_device import ONNX_DEVICE_PACKAGES, run_device

    folder, model = real
    onnx = json.loads((folder / "kvexport.json").read_text())["target"] == "onnx"
    guard = {"allowed": ONNX_DEVICE_PACKAGES} if onnx else {"blocked": {"transformers", "typer", "rich", "click"}}
    done = run_device([folder, "--prompt", SHORT_PROMPT, "--max-new-tokens", 48, "--ignore-eos", "--json"], **guard)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["new_ids"] == reference_ids(model, result["prompt_ids"], long_generation(folder))[:48]


def test_gemma3_is_refused_in_float16(tmp_path, capsys):
    """Its residual stream passes float16's 65,504: eager float16 gives NaN logits, its float16 .pte
    generated token 0 throughout. Refused after loading, before anything is written."""
    out = tmp_path / "gemma16"
    with pytest.raises(SystemExit) as done:
        main(["export", "gemma3-270m", "--dtype", "float16", "-o", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "Traceback" not in err, err
    assert "the model overflows in float16" in err and "at layer 8 of 18" in err, err
    assert not out.exists()


TURNS = ["What is the capital of France?", "And the capital of Italy?", "Which of the two cities is larger?"]


def test_chat_feeds_only_each_new_turn_and_renders_transformers_ids(real):
    """Three turns: each prompt is transformers' apply_chat_template of the whole conversation, and
    the second and third turns prefill only what is new since the last call (the cache is kept)."""
    from transformers import AutoTokenizer

    import kvexport

    folder, _ = real
    reference = AutoTokenizer.from_pretrained(folder)
    conversation = kvexport.load(folder).chat(max_new_tokens=32)
    messages, cached = [], 0
    for i, text in enumerate(TURNS):
        messages.append({"role": "user", "content": text})
        turn = conversation.say(text)
        expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
        assert turn.prompt_ids == expected
        if i:
            assert not turn.reset and turn.prefilled_tokens == len(expected) - cached, turn
        messages.append({"role": "assistant", "content": turn.text})
        cached = turn.conversation_tokens
