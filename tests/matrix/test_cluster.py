"""``kvexport matrix --ray``: rows as Ray tasks on a real two-node cluster that the tests start on
this machine (``ray.cluster_utils.Cluster``: a head and a second node, each its own raylet as
``ray start`` makes them; the second has a ``gpu_like`` resource that stands in for a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.helpers import assert_one_line_error, on_one_worker, run_cli

ray = pytest.importorskip("ray", reason="Ray is kvexport[ray], an optional dependency")

# The clusters and their rows share the machine's cores: one test at a time.
pytestmark = on_one_worker("ray-cluster")

ROWS = """
[defaults]
max_cache_len = 32
check_new_tokens = 4
run_new_tokens = 4
"""
MATRIX = ROWS + """
[[row]]
model = "tiny-llama"
target = "onnx"
[[row]]
model = "tiny-llama"
target = "executorch"
sdpa_query = "per-head"  # auto times both forms on this machine: another test's load could flip its choice between the two runs
[[row]]
model = "tiny-gemma3"
target = "onnx"
resources = {gpu_like = 1}
[[row]]
model = "tiny-stablelm"  # refused by the export: a failure of its own, not retried
target = "onnx"

[models.tiny-stablelm]
model_type = "stablelm"
"""
# A node that stops answering is declared dead within seconds, not Ray's default half a minute.
QUICK_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 3}
# What differs between two runs of the same row: timings, where it ran, where its log is.
VOLATILE = {"row_seconds", "log", "ran_on", "export_seconds", "export_steps", "export_peak_rss_mb",
            "prefill_tokens_per_s", "decode_tokens_per_s"}


def _stable(row: dict) -> dict:
    """A row's report without what differs between two runs of it. onnxruntime-genai's logits
    depend on how many threads its session has (a cluster row's cores), so its largest difference
    from eager is compared within a tolerance instead."""
    stable = {k: v for k, v in row.items() if k not in VOLATILE}
    if stable.get("genai"):
        stable["genai"] = {k: v for k, v in stable["genai"].items() if k != "max_logit_diff"}
    return stable


def start_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": QUICK_NODE_DEATH})
    second = cluster.add_node(num_cpus=1, resources={"gpu_like": 1})
    cluster.wait_for_nodes()
    return cluster, second


@pytest.fixture(scope="module")
def cluster():
    cluster, second = start_cluster()
    yield cluster, second
    cluster.shutdown()


@pytest.fixture(scope="module")
def ray_and_local(cluster, tmp_path_factory):
    """The matrix run on the cluster and run here, one after the other: both JSON reports, the
    cluster run's markdown and exit code."""
    folder = tmp_path_factory.mktemp("ray-matrix")
    (folder / "m.toml").write_text(MATRIX)
    capsys = _Capture()
    code = run_cli(capsys, "matrix", folder / "m.toml", "--ray", cluster[0].address, "--json", folder / "ray.json",
                   "--report", folder / "ray.md", "--work-dir", folder / "ray-work")[0]
    run_cli(capsys, "matrix", folder / "m.toml", "--json", folder / "local.json", "--work-dir", folder / "local-work")
    reports = {name: json.loads((folder / f"{name}.json").read_text()) for name in ("ray", "local")}
    return reports, (folder / "ray.md").read_text(), code


class _Capture:
    def readouterr(self):
        return "", ""


def test_rows_land_on_the_node_their_resources_ask_for(cluster, ray_and_local):
    reports, markdown, code = ray_and_local
    _, second = cluster
    rows = reports["ray"]["rows"]
    assert code == 1  # the stablelm row fails
    assert rows[2]["model"] == "tiny-gemma3" and rows[2]["status"] == "pass"
    assert rows[2]["ran_on"]["node_id"] == second.node_id
    assert all(row["ran_on"]["attempts"] == 1 for row in rows)
    refused = rows[3]
    assert refused["status"] == "error" and refused["failure"]["stage"] == "export"  # its own failure, run once
    assert "## Where rows ran" in markdown and f"({second.node_id[:8]}): " in markdown


def test_the_cluster_s_report_is_the_local_run_s(ray_and_local):
    reports, _, _ = ray_and_local
    ray_rows, local_rows = reports["ray"]["rows"], reports["local"]["rows"]
    assert [r["status"] for r in ray_rows] == ["pass", "pass", "pass", "error"]
    assert [_stable(r) for r in ray_rows] == [_stable(r) for r in local_rows]
    for ray_row, local_row in zip(ray_rows, local_rows):
        if (ray_row.get("genai") or {}).get("max_logit_diff") is not None:
            assert ray_row["genai"]["max_logit_diff"] == pytest.approx(local_row["genai"]["max_logit_diff"], abs=1e-5)
    assert {k: v for k, v in reports["ray"].items() if k != "rows"} == {k: v for k, v in reports["local"].items() if k != "rows"}


def test_a_row_no_node_can_hold_is_refused_without_waiting(cluster, tmp_path, capsys):
    (tmp_path / "m.toml").write_text(ROWS + '[[row]]\nmodel = "tiny-llama"\nresources = {tpu = 1}\n'
                                            '[[row]]\nmodel = "tiny-llama"\ntarget = "onnx"\nmemory_gb = 100000\n')
    start = time.monotonic()
    code, _, err = run_cli(capsys, "matrix", tmp_path / "m.toml", "--ray", cluster[0].address, "--json", tmp_path / "r.json")
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert code == 1 and time.monotonic() - start < 60
    assert [r["failure"]["stage"] for r in rows] == ["cluster", "cluster"]
    assert "no node of the Ray cluster has what the row asks for (tpu 1" in rows[0]["failure"]["reason"]
    assert "memory 100000.0 GiB" in rows[1]["failure"]["reason"]


def test_a_node_killed_mid_row_has_its_row_run_again_on_another(tmp_path):
    """Two rows start, one on each node (one CPU each); the second node is killed while both run:
    its row runs again on the head, and the report has both rows, passed."""
    (tmp_path / "m.toml").write_text(ROWS + '[[row]]\nmodel = "tiny-llama"\ntarget = ["executorch", "onnx"]\n')
    cluster, second = start_cluster()
    head = cluster.head_node.node_id
    try:
        driver = subprocess.Popen(
            [sys.executable, "-m", "kvexport.cli", "matrix", str(tmp_path / "m.toml"), "--ray", cluster.address,
             "--json", str(tmp_path / "r.json"), "--report", str(tmp_path / "r.md"), "--work-dir", str(tmp_path / "work")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        deadline = time.monotonic() + 120
        while len(list((tmp_path / "work").glob("*/log.txt"))) < 2:  # both rows' processes have started
            assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()[0]
            time.sleep(0.2)
        cluster.remove_node(second, allow_graceful=False)
        output = driver.communicate(timeout=400)[0]
    finally:
        if driver.poll() is None:
            driver.kill()
        cluster.shutdown()
    assert driver.returncode == 0, output
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["pass", "pass"]
    again = [r for r in rows if r["ran_on"]["attempts"] == 2]
    assert len(again) == 1 and again[0]["ran_on"]["node_id"] == head
    assert "(attempt 2)" in (tmp_path / "r.md").read_text() and "(attempt 2) ..." in output
    print(output)


def test_without_ray_installed_the_run_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    (tmp_path / "m.toml").write_text(ROWS + '[[row]]\nmodel = "tiny-llama"\n')
    code, _, err = run_cli(capsys, "matrix", tmp_path / "m.toml", "--ray", "local")
    assert_one_line_error(code, err, "--ray needs Ray", "pip install 'kvexport[ray]'")


def test_a_work_folder_url_is_for_ray_runs(tmp_path, capsys):
    (tmp_path / "m.toml").write_text(ROWS + '[[row]]\nmodel = "tiny-llama"\n')
    code, _, err = run_cli(capsys, "matrix", tmp_path / "m.toml", "--work-dir", f"file://{tmp_path}/work")
    assert_one_line_error(code, err, "a URL is for --ray runs")


def test_a_url_work_folder_gets_each_row_s_folder_uploaded(cluster, tmp_path, capsys):
    (tmp_path / "m.toml").write_text(ROWS + '[[row]]\nmodel = "tiny-llama"\ntarget = "onnx"\n')
    url = f"file://{tmp_path}/store/runs"
    code, _, _ = run_cli(capsys, "matrix", tmp_path / "m.toml", "--ray", cluster[0].address, "--work-dir", url,
                         "--keep-artifacts", "--json", tmp_path / "r.json")
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    uploaded = tmp_path / "store" / "runs" / row["id"]
    assert code == 0 and row["log"] == f"{url}/{row['id']}/log.txt"
    assert (uploaded / "log.txt").is_file() and (uploaded / "artifact" / "kvexport.json").is_file()
