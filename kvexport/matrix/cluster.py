"""``kvexport matrix MATRIX.toml --ray ADDRESS``: each row a Ray task, anywhere on a cluster.

A row runs on its node exactly as it runs locally (``runner.run_row_process``: its own child
process, its ``timeout_s``, its folder under the work folder), inside a Ray task that asks for the
row's resources: ``cpus``, its memory (``memory_gb``, else the export's memory plan), a GPU for a
``device = "cuda"`` row, and its custom ``resources``. The results travel back through Ray, so the
report is complete whatever the work folder; the rows' logs and artifacts stay in the work folder,
which every node must see (a shared file system), or go to an fsspec URL (``s3://...``), where each
row's folder is uploaded when the row ends.

Ray retries a task whose worker or node died (``RETRIES``); a row that fails on its own merit
returns its failure as its result, which Ray does not retry. A row that no live node of the cluster
can hold is recorded as failed, when it is submitted or later when such nodes have died, rather than
left waiting (Ray would wait for such a node forever).

``ADDRESS``: ``local`` starts a cluster on this machine for the run, ``auto`` joins the one this
machine belongs to, else a head's ``HOST:PORT`` or a Ray client's ``ray://HOST:PORT``.
"""

from __future__ import annotations

import logging
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import InvalidOptionError, KvexportError
from .report import node_label
from .runner import no_result, run_row_process
from .spec import Row

RETRIES = 3  # new attempts of a row whose worker or node died under it
POLL_S = 1.0  # how often the driver looks for started and finished rows
PROGRESS_EVERY_S = 30.0  # a line of rows done / running / queued, per node
NODES_EVERY_S = 10.0  # how often the driver looks for rows that no live node can hold any more


def import_ray():
    try:
        import ray
    except ImportError:
        raise InvalidOptionError("--ray needs Ray, an optional dependency: pip install 'kvexport[ray]'") from None
    return ray


def run_rows_on_ray(
    rows: list[Row],
    work_dir: str,
    keep_artifacts: bool,
    address: str,
    on_start: Callable[[Row, dict], None] | None = None,
    on_done: Callable[[dict], None] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """Each row's result, as ``runner.run_rows`` gives it plus ``ran_on`` (the node, and how many
    attempts the row took), in row order; ``on_start(row, node)`` and ``on_done(result)`` as rows
    start and end, in the order they do."""
    ray = import_ray()
    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False,
             **({"include_dashboard": False} if address == "local" else {}))
    try:
        return _run(ray, rows, work_dir, keep_artifacts, on_start, on_done, on_progress)
    finally:
        ray.shutdown()


def _run(ray, rows, work_dir, keep_artifacts, on_start, on_done, on_progress) -> list[dict]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(max_retries=RETRIES, retry_exceptions=False)(_row_task)
    # On the driver's node: a node that dies takes its rows with it, not what the driver knows of the others.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    tracker = ray.remote(num_cpus=0)(Tracker).options(scheduling_strategy=here).remote()
    results: dict[int, dict] = {}
    pending: dict = {}  # each submitted row's task, and what it asks for
    nodes = _live_nodes(ray)
    for row in rows:
        request = resource_request(row)
        if not _some_node_holds(nodes, request):
            results[row.index] = _unschedulable(row, request)
            _call(on_done, results[row.index])
            continue
        options = {"num_cpus": request["CPU"], "num_gpus": request["GPU"], "memory": request["memory"],
                   "resources": {k: v for k, v in request.items() if k not in ("CPU", "GPU", "memory")}}
        pending[task.options(**options).remote(row.to_dict(), work_dir, keep_artifacts, tracker)] = row, request
    started: dict[int, dict] = {}
    last_progress = last_nodes = time.monotonic()
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            # After the wait: a row that has ended has told the tracker it started.
            for index, node in ray.get(tracker.started.remote()).items():
                if started.get(index) != node:
                    started[index] = node
                    _call(on_start, next(r for r in rows if r.index == index), node)
            for ref in ready:
                row, _ = pending.pop(ref)
                results[row.index] = _result(ray, ref, row, started.get(row.index))
                _call(on_done, results[row.index])
            if time.monotonic() - last_nodes >= NODES_EVERY_S:  # nodes die: Ray would wait for one that can hold a row
                nodes = _live_nodes(ray)
                for ref, (row, request) in list(pending.items()):
                    if not _some_node_holds(nodes, request):
                        ray.cancel(ref, force=True)
                        del pending[ref]
                        results[row.index] = _unschedulable(row, request)
                        _call(on_done, results[row.index])
                last_nodes = time.monotonic()
            if on_progress and time.monotonic() - last_progress >= PROGRESS_EVERY_S:
                on_progress(progress_line(rows, started, results))
                last_progress = time.monotonic()
    finally:
        for ref in pending:  # interrupted: the cluster does not go on with rows no one waits for
            ray.cancel(ref, force=True)
    return [results[row.index] for row in rows]


def resource_request(row: Row) -> dict:
    """What the row's task asks of a node: ``CPU``, ``GPU``, ``memory`` (bytes) and custom resources."""
    memory = row.memory_gb * 2**30 if row.memory_gb else planned_memory_bytes(row)
    return {**(row.resources or {}), "CPU": row.cpus, "GPU": 1 if row.device == "cuda" else 0, "memory": int(memory)}


def planned_memory_bytes(row: Row) -> int:
    """The peak of the row's export as its memory plan says (``exporter.memory_plan``), from the
    model's config and the row's options (a real-shape model's config written on its own); for a
    tiny model built from a ``[models.NAME]`` config in the row, or one the export will refuse (the
    row then fails on its own), the libraries' own share alone."""
    from ..exporter import memory_plan
    from ..exporter.pipeline import ExportOptions, plan_export, plan_footprint
    from ..models import real_shapes

    if row.tiny_config is None:
        with tempfile.TemporaryDirectory(prefix="kvexport-plan-") as tmp:
            model = row.model
            if row.shape_config:
                model = str(Path(tmp) / "config")
                config = real_shapes.shape_config(row.shape_config["shape"], row.shape_config["overrides"])
                real_shapes.write_model(config, Path(model), config_only=True)
            options = ExportOptions(model=model, out=Path(tmp) / "plan", **row.export_options())
            try:
                needs = plan_footprint(plan_export(options))
            except KvexportError:
                needs = None
        if needs is not None:
            return needs.peak_bytes
    return memory_plan.BASE_BYTES[row.target]


def _live_nodes(ray) -> list[dict]:
    """Each live node's resources (in all, free or not)."""
    return [node["Resources"] for node in ray.nodes() if node["Alive"]]


def _some_node_holds(nodes: list[dict], request: dict) -> bool:
    return any(all(node.get(name, 0) >= amount for name, amount in request.items() if amount) for node in nodes)


def _unschedulable(row: Row, request: dict) -> dict:
    asked = ", ".join(f"{name} {amount / 2**30:.1f} GiB" if name == "memory" else f"{name} {amount:g}"
                      for name, amount in request.items() if amount)
    reason = f"no node of the Ray cluster has what the row asks for ({asked})"
    return {**row.to_dict(), **no_result(reason, "cluster"), "row_seconds": None}


def _result(ray, ref, row: Row, node: dict | None) -> dict:
    """The row's result, its ``ran_on`` with the attempts the tracker counted (``node``)."""
    try:
        result = ray.get(ref)
        return {**result, "ran_on": {**result["ran_on"], "attempts": node["attempts"] if node else 1}}
    except ray.exceptions.RayError as e:  # the task itself failed: its retries spent, or a bug in it
        lines = str(e).strip().splitlines()
        reason = f"its Ray task failed: {type(e).__name__}: {lines[0] if lines else ''}"
        return {**row.to_dict(), **no_result(reason, "cluster"), "row_seconds": None, **({"ran_on": node} if node else {})}


def progress_line(rows: list[Row], started: dict[int, dict], results: dict[int, dict]) -> str:
    """``N done, N running, N queued``, then each node's running and done rows."""
    running = [i for i in started if i not in results]
    per_node: dict[str, list[int]] = {}
    for index in running:
        per_node.setdefault(node_label(started[index]), [0, 0])[0] += 1
    for result in results.values():
        if "ran_on" in result:
            per_node.setdefault(node_label(result["ran_on"]), [0, 0])[1] += 1
    nodes = "; ".join(f"{label}: {r} running, {d} done" for label, (r, d) in sorted(per_node.items()))
    queued = len(rows) - len(results) - len(running)
    return f"{len(results)} done, {len(running)} running, {queued} queued" + (f" · {nodes}" if nodes else "")


class Tracker:
    """A Ray actor the rows' tasks tell when they start (which node, which attempt)."""

    def __init__(self):
        self._started: dict[int, dict] = {}

    def start(self, index: int, node: dict) -> None:
        attempts = self._started.get(index, {}).get("attempts", 0) + 1
        self._started[index] = {**node, "attempts": attempts}

    def started(self) -> dict[int, dict]:
        return self._started


def _row_task(row: dict, work_dir: str, keep_artifacts: bool, tracker) -> dict:
    """On a node: run the row in its child process, with as many threads as the CPUs it asked for;
    the result says where. The tracker is told without waiting for its answer: a task that waits on
    another gives its CPUs back to Ray meanwhile, and a second row would start beside it."""
    import os

    import ray

    from ..runtime.cpu import THREADS_ENV

    row = Row.from_dict(row)
    os.environ[THREADS_ENV] = os.environ["OMP_NUM_THREADS"] = str(row.cpus)
    node = {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname()}
    tracker.start.remote(row.index, node)
    return {**run_in_work_dir(row, work_dir, keep_artifacts), "ran_on": node}


def run_in_work_dir(row: Row, work_dir: str, keep_artifacts: bool) -> dict:
    """``run_row_process`` in ``work_dir`` (a folder), or in a temporary folder uploaded to
    ``work_dir/ROW_ID`` when it is an fsspec URL (``s3://bucket/runs``, ``file:///shared/runs``)."""
    if "://" not in work_dir:
        return run_row_process(row, Path(work_dir), keep_artifacts)
    import fsspec

    fs, root = fsspec.core.url_to_fs(work_dir)
    remote = f"{root.rstrip('/')}/{row.id}"
    with tempfile.TemporaryDirectory(prefix="kvexport-row-") as local:
        result = run_row_process(row, Path(local), keep_artifacts)
        if fs.exists(remote):
            fs.rm(remote, recursive=True)
        fs.put(f"{Path(local) / row.id}/", remote, recursive=True)
    return {**result, "log": f"{work_dir.rstrip('/')}/{row.id}/log.txt"}


def _call(callback, *args) -> None:
    if callback:
        callback(*args)
