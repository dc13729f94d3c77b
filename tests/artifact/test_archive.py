"""kvexport pack: one archive per artifact, and no byte of it changed or missing goes unnoticed."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from kvexport.errors import ArtifactError, InvalidOptionError
from kvexport.artifact.archive import open_artifact, pack

from tests.helpers import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def packed(artifact, tmp_path_factory):
    """(folder, archive) of a small ONNX artifact."""
    folder = artifact("tiny-gemma3", "onnx")
    archive, _ = pack(folder, tmp_path_factory.mktemp("packed") / "tiny.tar")
    return folder, archive


def member_spans(archive) -> dict[str, tuple[int, int]]:
    """Each member's (header offset, data offset) in the archive."""
    with tarfile.open(archive) as tar:
        return {m.name.split("/", 1)[1]: (m.offset, m.offset_data) for m in tar.getmembers()}


def test_the_archive_is_the_folder_under_its_name_manifest_first(packed, tmp_path, capsys):
    folder, archive = packed
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    listed = json.loads((folder / "kvexport.json").read_text())["files"]
    assert names == [f"{folder.name}/{n}" for n in ["kvexport.json", "kvexport.json.sha256", *listed]]
    with open_artifact(archive) as (unpacked, manifest):
        assert manifest.to_json() == json.loads((folder / "kvexport.json").read_text())
        for name in listed:
            assert (unpacked / name).read_bytes() == (folder / name).read_bytes()
    assert not unpacked.exists()  # the temporary folder is gone
    code, out, err = run_cli(capsys, "pack", folder, "-o", tmp_path / "tiny.tgz", "--json")
    assert code == 0, err
    result = json.loads(out)
    with open_artifact(tmp_path / "tiny.tgz") as (_, manifest):
        assert manifest.to_json()["files"] == listed
    assert len(result["sha256"]) == 64 and result["bytes"] < archive.stat().st_size  # gzipped


@pytest.mark.parametrize("where", ["data", "header"])
def test_one_flipped_byte_in_any_member_is_refused(packed, tmp_path, where):
    _, archive = packed
    data = archive.read_bytes()
    for name, (header, start) in member_spans(archive).items():
        corrupt = bytearray(data)
        corrupt[start + 7 if where == "data" else header + 3] ^= 0x01  # in the data, or in the member's name
        path = tmp_path / f"{name}.tar"
        path.write_bytes(bytes(corrupt))
        with pytest.raises(ArtifactError) as refused:
            with open_artifact(path):
                pytest.fail(f"{where} of {name}: a corrupt archive was opened")
        assert str(path) in str(refused.value) and "\n" not in str(refused.value)


def test_a_truncated_archive_is_refused(packed, tmp_path):
    _, archive = packed
    data = archive.read_bytes()
    spans = sorted(member_spans(archive).values())
    # Inside a member's data, at a member boundary (files missing), and one byte into the last member.
    for cut in (len(data) // 2, spans[-1][0], spans[-1][1] + 1):
        path = tmp_path / f"cut-{cut}.tar"
        path.write_bytes(data[:cut])
        with pytest.raises(ArtifactError, match="truncated|missing"):
            with open_artifact(path):
                pytest.fail(f"an archive cut at {cut} of {len(data)} bytes was opened")


def test_what_is_not_a_kvexport_archive_is_refused(tmp_path):
    (tmp_path / "junk.tar").write_bytes(b"not an archive" * 100)
    with pytest.raises(ArtifactError, match="is not a tar archive"):
        with open_artifact(tmp_path / "junk.tar"):
            pass
    with tarfile.open(tmp_path / "evil.tar", "w") as tar:  # a member that would land outside the folder
        info = tarfile.TarInfo("../evil.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    with pytest.raises(ArtifactError, match="not a kvexport archive .*'../evil.txt'"):
        with open_artifact(tmp_path / "evil.tar"):
            pass
    assert not (tmp_path / "evil.txt").exists()
    with pytest.raises(ArtifactError, match="does not exist"):
        with open_artifact(tmp_path / "missing.tar"):
            pass


def test_pack_refuses_a_corrupt_folder_and_an_existing_archive(packed, tmp_path, capsys):
    import shutil

    folder, archive = packed
    code, _, err = run_cli(capsys, "pack", folder, "-o", archive)
    assert_one_line_error(code, err, "already exists", "--force")
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    data = bytearray((copy / "model.onnx.data").read_bytes())
    data[100] ^= 0x01
    (copy / "model.onnx.data").write_bytes(bytes(data))
    code, _, err = run_cli(capsys, "pack", copy)
    assert_one_line_error(code, err, "model.onnx.data does not match the sha256")
    assert not (tmp_path / "copy.tar").exists()
    with pytest.raises(InvalidOptionError, match="does not exist"):
        pack(folder, tmp_path / "no-such-folder" / "x.tar")


@pytest.mark.parametrize(
    "member",
    ["/kvexport.json", "/x/kvexport.json", "x/../kvexport.json", "x/sub/kvexport.json"],
    ids=["absolute", "absolute-in-a-folder", "up-a-folder", "in-a-subfolder"],
)
def test_a_member_outside_one_top_folder_is_refused_in_one_line(tmp_path, member):
    with tarfile.open(tmp_path / "odd.tar", "w") as tar:
        info = tarfile.TarInfo(member)
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    with pytest.raises(ArtifactError, match="is not a kvexport archive .*unexpected member"):
        with open_artifact(tmp_path / "odd.tar"):
            pytest.fail("opened")


def _snapshot(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize(
    "where",
    ["a-file-of-it", "a-new-file-in-it", "the-folder-itself", "through-a-link-to-it"],
)
def test_pack_refuses_an_output_inside_the_artifact(packed, tmp_path, capsys, where):
    """`kvexport pack DIR -o DIR/model.pte --force` replaced the program with the archive of itself."""
    import shutil

    folder, _ = packed
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    (tmp_path / "link").symlink_to(copy)
    out = {
        "a-file-of-it": copy / "model.onnx",
        "a-new-file-in-it": copy / "copy.tar",
        "the-folder-itself": copy,
        "through-a-link-to-it": tmp_path / "link" / "model.onnx",
    }[where]
    before = _snapshot(tmp_path)
    code, _, err = run_cli(capsys, "pack", copy, "-o", out, "--force")
    assert_one_line_error(code, err, "is inside the artifact folder", "choose an -o outside it")
    assert _snapshot(tmp_path) == before


def test_pack_to_a_place_it_cannot_write_gets_one_line(packed, tmp_path, capsys):
    folder, _ = packed
    # /sys refuses new files to root too (see test_cli's test_an_unwritable_output_is_refused_before_loading).
    code, _, err = run_cli(capsys, "pack", folder, "-o", "/sys/kvexport.tar")
    assert_one_line_error(code, err, "cannot write /sys/kvexport.tar", "choose another -o")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-folder" / "notes.txt").write_text("keep me")
    code, _, err = run_cli(capsys, "pack", folder, "-o", tmp_path / "a-folder", "--force")
    assert_one_line_error(code, err, "a-folder is a folder; -o names the archive file", "a-folder/")
    assert (tmp_path / "a-folder" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-folder"]
