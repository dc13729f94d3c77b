"""kvexport bench on tiny artifacts: every path measured, the report sane (no timing thresholds)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnxruntime as ort
import pytest
import torch

from kvexport.bench import machine_load
from kvexport.bench.bench import BenchOptions, exact_prompt, prompt_lengths, run_bench
from kvexport.bench.report import busy_lines
from kvexport.bench.summary import ratios
from tests.helpers import assert_one_line_error, fake_manifest, run_cli


def test_bench_measures_every_path(artifact, tmp_path, capsys):
    pte, onnx = artifact("tiny-gemma3", "executorch"), artifact("tiny-gemma3", "onnx")
    # Another exporter's program stands in as a bare .pte with its .ptd beside it (no kvexport.json).
    other = tmp_path / "other"
    other.mkdir()
    for name in ("model.pte", "model.ptd"):
        shutil.copy(pte / name, other / name)
    # And another exporter's onnxruntime-genai folder: the ONNX artifact without kvexport's manifest.
    other_genai = tmp_path / "other-genai"
    shutil.copytree(onnx, other_genai, ignore=shutil.ignore_patterns("kvexport.json*"))
    out = tmp_path / "bench.json"
    code, table, _ = run_cli(capsys, "bench", "tiny-gemma3", pte, onnx, "--prompt-tokens", "8", "--new-tokens", "6",
                             "--repeats", "1", "--threads", "1", "--json", out, "--markdown", tmp_path / "b.md",
                             "--pte", other / "model.pte", "--genai-folder", other_genai)
    assert code == 0
    report = json.loads(out.read_text())
    assert table.strip() == (tmp_path / "b.md").read_text().strip() and "| path |" in table

    (context,) = report["contexts"]
    paths = {(p["path"], Path(p.get("pte") or p.get("genai_folder") or p.get("artifact") or "").name or None): p
             for p in context["paths"]}
    assert set(paths) == {("eager", None), ("run", pte.name), ("run", onnx.name), ("textllm", pte.name),
                          ("textllm", "model.pte"), ("genai", onnx.name), ("genai", "other-genai"), ("llama", None)}
    assert "no GGUF" in paths["llama", None]["skipped"]  # a preset has no GGUF file
    assert report["protocol"] == {**report["protocol"], "prompt_tokens": [8], "new_tokens": 6, "threads": 1}
    assert context["prompt_tokens"] == 8 and "traffic" not in report  # one length: no table by length
    for key, job in paths.items():
        if key[0] == "llama":
            continue
        (run,) = job["runs"]
        assert "error" not in run, (key, run)
        assert run["prompt_tokens"] == 8 and run["new_tokens"] == 6 and run["decode_steps"] == 5, (key, run)
        for metric in ("ttft_ms", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_mb", "load_s"):
            summary = job["summary"][metric]
            if key[0] == "textllm" and metric in ("ttft_ms", "prefill_tokens_per_s", "decode_tokens_per_s"):
                assert summary is None or summary["median"] >= 0  # its Stats count whole milliseconds: maybe 0
                continue
            assert summary["median"] > 0, (key, metric)
        assert 10 < run["peak_rss_mb"] < 8000 and 0 <= run["ttft_ms"] < 60_000, (key, run)
    # fp32 artifacts generate eager's tokens; TextLLMRunner prints kvexport run's text.
    assert paths["run", pte.name]["same_tokens_as_eager"] == 6
    assert paths["run", onnx.name]["same_tokens_as_eager"] == 6
    assert paths["genai", onnx.name]["same_tokens_as_eager"] == paths["genai", "other-genai"]["same_tokens_as_eager"] == 6
    assert paths["textllm", pte.name]["same_text_as_run"] is True
    assert paths["textllm", "model.pte"]["label"].endswith("other/model.pte")
    assert "same_text_as_run" not in paths["textllm", "model.pte"]  # not kvexport run's program
    # A ratio wherever both medians exist: TextLLMRunner's 5 tiny decode steps may round to 0 ms.
    textllm_decode = (paths["textllm", pte.name]["summary"]["decode_tokens_per_s"] or {}).get("median")
    assert set(context["ratios"]["run_vs_textllm"]) == ({str(pte)} if textllm_decode else set())
    other_decode = (paths["textllm", "model.pte"]["summary"]["decode_tokens_per_s"] or {}).get("median")
    assert len(context["ratios"]["decode_vs_eager"]) == 4 + bool(textllm_decode) + bool(other_decode)
    assert context["ratios"]["decode_vs_llama"] == {} and "| decode × llama.cpp |" in table  # llama.cpp skipped
    # Other load sampled before each of the 7 runs (Linux), and the header says how much there was.
    assert report["machine"]["background_busy"]["n"] == 7 and "CPUs busy between runs" in table


def test_bench_prompt_has_exactly_the_requested_tokens(artifact):
    from kvexport.runtime.tokenizer import ArtifactTokenizer

    tokenizer = ArtifactTokenizer(artifact("tiny-gemma3", "executorch"))
    for n in (2, 7, 40):
        text, ids = exact_prompt(tokenizer, n)
        assert len(ids) == n and tokenizer.encode(text) == ids
    # One token: the BOS the tokenizer adds to any prompt (issue 58, class 9: was bench's own message).
    assert exact_prompt(tokenizer, 1) == ("", tokenizer.encode(""))


def test_bench_refuses_fewer_prompt_tokens_than_the_tokenizer_adds_in_one_line():
    from kvexport.errors import InvalidOptionError

    class TwoSpecials:
        def encode(self, text):
            return [0, *map(ord, text), 1]

    with pytest.raises(InvalidOptionError, match="--prompt-tokens 1: this tokenizer adds 2 special tokens to every prompt"):
        exact_prompt(TwoSpecials(), 1)


def test_bench_refuses_a_prompt_that_does_not_fit(artifact):
    from kvexport.errors import PromptTooLongError

    with pytest.raises(PromptTooLongError):
        run_bench(BenchOptions("tiny-gemma3", [artifact("tiny-gemma3", "onnx")], [60], new_tokens=10))


def test_ratios_divide_each_decode_median_by_eager_and_llama():
    def job(path, decode, artifact=None):
        return {"path": path, "label": f"{path} {artifact}", "artifact": artifact,
                "summary": {"decode_tokens_per_s": {"median": decode} if decode else None}}

    jobs = [job("eager", 10.0), job("run", 60.0, "a"), job("textllm", 50.0, "a"), job("run", 30.0, "b"),
            job("llama", 40.0)]
    r = ratios(jobs)
    assert r["decode_vs_eager"] == {"run a": 6.0, "textllm a": 5.0, "run b": 3.0, "llama None": 4.0}
    assert r["decode_vs_llama"] == {"eager None": 0.25, "run a": 1.5, "textllm a": 1.25, "run b": 0.75}
    assert r["run_vs_textllm"] == {"a": 1.2}
    assert r["run_vs_textllm_by_round"] == {}  # no rounds in these jobs: no paired ratio
    # llama.cpp not installed (skipped, no median): no ratio against it, the others stay.
    jobs[-1]["summary"]["decode_tokens_per_s"] = None
    r = ratios(jobs)
    assert r["decode_vs_llama"] == {} and r["decode_vs_eager"]["run a"] == 6.0


def test_other_load_between_runs_is_measured_and_flagged(tmp_path, monkeypatch):
    # machine_load reads /proc/stat from a file the test writes.
    stat, real_path = tmp_path / "stat", machine_load.Path
    monkeypatch.setattr(machine_load, "Path", lambda p: real_path(stat if p == "/proc/stat" else p))
    #                 user nice system idle iowait irq softirq steal
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\n")
    assert machine_load.cpu_times() == (150, 1000)

    samples = iter(["cpu  100 0 50 800 50 0 0 0 0 0\n", "cpu  130 0 60 950 60 0 0 0 0 0\n"])
    monkeypatch.setattr(machine_load.time, "sleep", lambda s: stat.write_text(next(samples)))
    stat.write_text(next(samples))
    assert machine_load.background_busy() == pytest.approx(40 / 200)  # 40 of 200 jiffies busy, iowait idle

    idle = {"median": 0.01, "min": 0.0, "max": 0.03, "n": 5}
    assert busy_lines(idle) == ["", "CPUs busy between runs (other processes): median 1%, max 3%."]
    shared = busy_lines({**idle, "max": 0.2})[1]
    assert "max 20%" in shared and "not idle" in shared
    assert busy_lines(None) == []  # no /proc/stat: nothing claimed


def test_run_against_textllm_is_also_paired_round_by_round():
    """A slow spell that catches kvexport run's rounds and not TextLLMRunner's moves the ratio of
    the medians; each round's own ratio (the two paths back to back) mostly does not."""
    run = [200.0, 200.0, 250.0, 250.0, 200.0]
    textllm = [200.0, 250.0, 260.0, 260.0, 260.0]
    jobs = [{"path": path, "label": path, "artifact": "a",
             "runs": [{"decode_tokens_per_s": v} for v in values],
             "summary": {"decode_tokens_per_s": {"median": sorted(values)[2]}}}
            for path, values in (("run", run), ("textllm", textllm))]
    jobs[0]["runs"][1] = {"error": "crashed"}  # a failed round pairs with nothing
    r = ratios(jobs)
    assert r["run_vs_textllm"] == {"a": 200.0 / 260.0}
    # Rounds 1, 3, 4, 5: 1.0, 250/260, 250/260, 200/260; their median is 250/260.
    assert r["run_vs_textllm_by_round"] == {"a": pytest.approx(250 / 260)}


def test_bench_measures_each_prompt_length_and_its_traffic_limit(artifact, tmp_path, capsys):
    """Several --prompt-tokens: every path at each length (a table each), and for kvexport's paths
    decode by length beside the traffic limit, which the shortest length reaches by definition."""
    pte = artifact("tiny-gemma3", "executorch")
    out = tmp_path / "bench.json"
    code, table, _ = run_cli(capsys, "bench", "tiny-gemma3", pte, "--prompt-tokens", "20,4", "--new-tokens", "6",
                             "--repeats", "1", "--threads", "1", "--paths", "eager,run", "--json", out)
    assert code == 0
    report = json.loads(out.read_text())
    assert report["protocol"]["prompt_tokens"] == [4, 20]
    assert [c["prompt_tokens"] for c in report["contexts"]] == [4, 20]
    for context in report["contexts"]:
        (run,) = next(p for p in context["paths"] if p["path"] == "run")["runs"]
        assert run["prompt_tokens"] == context["prompt_tokens"] and run["decode_steps"] == 5
    eager, run = sorted(report["traffic"])  # eager's label sorts first
    assert eager.startswith("eager") and run.startswith("kvexport run")
    for label in (eager, run):
        short, long = report["traffic"][label]["4"], report["traffic"][label]["20"]
        assert short["share_of_limit"] == pytest.approx(1.0)
        # 20 positions read more of the 64-slot buffer than 4 do (the 6-slot ring the same): a lower limit.
        assert long["step_bytes"] > short["step_bytes"] and long["limit_tokens_per_s"] < short["decode_tokens_per_s"]
    # Eager reads its own float32 parameters: the tiny model's, counted once where tied.
    from kvexport.models import sources

    model, _ = sources.load_model(sources.resolve("tiny-gemma3"))
    weights = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}.values())
    from kvexport.bench import traffic
    from kvexport.artifact.manifest import read_manifest

    assert report["traffic"][eager]["4"]["step_bytes"] == weights + traffic.cache_bytes_read(read_manifest(pte), 4 + 3, 4)
    assert "4-token prompt:" in table and "20-token prompt:" in table and "| 4 tokens | 20 tokens |" in table


def test_bench_refuses_prompt_lengths_it_cannot_read_in_one_line():
    from kvexport.errors import InvalidOptionError

    with pytest.raises(InvalidOptionError, match="'128,x' is not a length or comma-separated lengths"):
        prompt_lengths("128,x")
    with pytest.raises(InvalidOptionError, match="must be at least 1"):
        BenchOptions("tiny-llama", [Path("a")], prompt_lengths("0,128"))


def test_a_step_reads_the_weights_and_the_rows_each_layer_attends_to():
    """A full layer reads every position so far, a ring at most its window, a sharing layer none;
    at the cache's own bytes per element (here float32: 4)."""
    from kvexport.bench import traffic

    from kvexport.artifact.manifest import FileEntry, Layer

    layer = {"kv_heads": 2, "head_dim": 16}
    manifest = fake_manifest(
        files={name: FileEntry("0" * 64, size) for name, size in (("model.pte", 1000), ("model.ptd", 9000), ("tokenizer.json", 500))},
        layers=(Layer(0, cache="static", slots=64, **layer), Layer(1, cache="ring", slots=6, **layer),
                Layer(2, cache="shared", slots=0, **layer), Layer(3, cache="conv", slots=3)),
        kv_cache_bytes=(64 + 6) * 2 * 2 * 16 * 4,
    )
    assert traffic.weight_bytes(manifest) == 10_000  # the program's files, not the tokenizer
    row = 2 * 2 * 16 * 4  # keys and values of one position in one layer
    assert traffic.cache_bytes_read(manifest, 3) == (3 + 3) * row
    assert traffic.cache_bytes_read(manifest, 10) == (10 + 6) * row
    assert traffic.cache_bytes_read(manifest, 100) == (64 + 6) * row
    # 50 tok/s at the shortest context; at a longer one the same bandwidth over more bytes.
    got = traffic.limits(manifest, {4: 50.0, 40: 20.0}, new_tokens=8)
    first, second = 10_000 + (8 + 6) * row, 10_000 + (44 + 6) * row
    assert got[4]["share_of_limit"] == pytest.approx(1.0)
    assert got[40]["limit_tokens_per_s"] == pytest.approx(50.0 * first / second)
    assert got[40]["share_of_limit"] == pytest.approx(20.0 / (50.0 * first / second))
    # Another program of the model: its own weights, the same rows at its own bytes per element.
    assert traffic.cache_bytes_read(manifest, 10, element_bytes=2) == (10 + 6) * row // 2
    other = traffic.limits(manifest, {4: 50.0, 40: 20.0}, new_tokens=8, weights=500, element_bytes=2)
    assert other[40]["step_bytes"] == 500 + (44 + 6) * row // 2


def test_another_exporters_program_counts_its_program_files(tmp_path):
    from kvexport.bench.traffic import other_program_bytes

    (tmp_path / "model.pte").write_bytes(b"p" * 300)
    (tmp_path / "model.ptd").write_bytes(b"d" * 700)
    (tmp_path / "other.ptd").write_bytes(b"x" * 5)  # another program's data
    assert other_program_bytes(tmp_path / "model.pte") == 1000
    genai = tmp_path / "genai"
    genai.mkdir()
    for name, size in (("model.onnx", 40), ("model.onnx.data", 960), ("genai_config.json", 9), ("tokenizer.json", 99)):
        (genai / name).write_bytes(b"g" * size)
    assert other_program_bytes(genai) == 1000


def test_a_drafter_given_by_a_relative_path_is_found_by_the_runs(artifact, monkeypatch):
    """Each run works in a folder of its own: a ``--draft`` folder relative to where bench was started
    reaches it as an absolute path."""
    from kvexport.artifact.manifest import read_manifest
    from kvexport.bench.bench import plan_jobs

    folder = artifact("tiny-llama", "onnx", max_draft_tokens=4)
    drafter = artifact("tiny-llama", "onnx", quantize="int4")
    monkeypatch.chdir(drafter.parent)
    options = BenchOptions("tiny-llama", [folder], paths=["run"], draft=["ngram", drafter.name], draft_tokens=[2])
    jobs = plan_jobs(options, {str(folder): read_manifest(folder)}, None, None)
    assert [job["draft"] for job in jobs if "draft" in job] == ["ngram", str(drafter.resolve())]


def test_every_path_but_llama_and_drafts_gets_a_traffic_limit(tmp_path):
    """kvexport's artifacts at their manifest's bytes; eager at the parameters it reported and its
    dtype; another exporter's program at its files, float32 rows; llama.cpp and drafted runs none."""
    from kvexport.artifact.manifest import FileEntry, Layer
    from kvexport.bench.summary import traffic_by_path

    (tmp_path / "other.pte").write_bytes(b"p" * 2000)
    manifest = fake_manifest(files={"model.onnx": FileEntry("0" * 64, 1000)},
                             layers=(Layer(0, cache="static", slots=64, kv_heads=1, head_dim=8),),
                             kv_cache_bytes=64 * 2 * 8)  # an int8 cache: one byte an element

    def job(path, label, speeds, **extra):
        return {"path": path, "label": label, "runs": [{"weight_bytes": 3000, "kv_element_bytes": 2}],
                "summary": {"decode_tokens_per_s": {"median": speeds}}, **extra}

    contexts = {n: [job("eager", "eager", 100.0 / i), job("run", "run", 90.0 / i, artifact="a"),
                    job("textllm", "other", 80.0 / i, artifact="a", pte=str(tmp_path / "other.pte")),
                    job("run", "drafted", 70.0 / i, artifact="a", draft="ngram"), job("llama", "llama", 60.0 / i)]
                for i, n in ((1, 4), (2, 36))}
    got = traffic_by_path(contexts, {"a": manifest}, new_tokens=8)
    assert set(got) == {"eager", "run", "other"}
    row = 2 * 8  # keys and values of one position, in elements
    assert got["run"][36]["step_bytes"] == 1000 + 40 * row
    assert got["eager"][36]["step_bytes"] == 3000 + 40 * row * 2
    assert got["other"][36]["step_bytes"] == 2000 + 40 * row * 4
    assert got["other"][4]["share_of_limit"] == pytest.approx(1.0)


def test_bench_on_cuda_refuses_what_it_cannot_measure_in_one_line(artifact, capsys):
    """``--device cuda`` measures eager and the ONNX runners; TextLLMRunner and llama.cpp run on the
    CPU, a `.pte` too. Refused before anything runs, a missing GPU too."""
    from kvexport.errors import InvalidOptionError

    half = artifact("tiny-gemma3", "onnx", dtype="float16")
    with pytest.raises(InvalidOptionError, match="--device cuda measures eager, run, genai; llama, textllm run on the CPU"):
        BenchOptions("tiny-gemma3", [half], paths=["eager", "textllm", "llama"], device="cuda")
    with pytest.raises(InvalidOptionError, match="unknown --device 'tpu'; choose cpu or cuda"):
        BenchOptions("tiny-gemma3", [half], device="tpu")
    if not torch.cuda.is_available():
        code, _, err = run_cli(capsys, "bench", "tiny-gemma3", half, "--device", "cuda", "--paths", "eager,run")
        assert_one_line_error(code, err, "--device cuda: no CUDA GPU is available here")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs a CUDA GPU and onnxruntime-gpu")
def test_bench_on_the_gpu_runs_eager_in_the_artifact_s_dtype_beside_it(artifact, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code, _, _ = run_cli(capsys, "bench", "tiny-gemma3", artifact("tiny-gemma3", "onnx", dtype="float16"), "--device", "cuda",
                         "--paths", "eager,run", "--prompt-tokens", "8,16", "--new-tokens", "6", "--repeats", "1", "--json", out)
    assert code == 0
    report = json.loads(out.read_text())
    assert report["machine"]["gpu"] and "traffic" not in report  # decode on a GPU is not bound by memory traffic
    for context in report["contexts"]:
        eager, run = context["paths"]
        assert "float16" in eager["label"] and run["runs"][0]["new_ids"] == eager["runs"][0]["new_ids"]
