"""An ONNX artifact's weights file travels as the model's GGUF: written back, byte for byte, where
the artifact runs (a GPU machine that can fetch nothing and takes files in small pieces).

  python scripts/onnx_data_from_gguf.py map ARTIFACT CONVERTED_FOLDER MAP.json
      where the artifact was exported: for every byte range of ARTIFACT/model.onnx.data, the tensor
      of CONVERTED_FOLDER (the GGUF's float32 folder kvexport converted, under KVEXPORT_CACHE) and
      the transpose whose bytes in the artifact's dtype it holds; ranges nothing maps (folded
      constants) go into MAP.raw beside MAP.json.
  python scripts/onnx_data_from_gguf.py rebuild MODEL.gguf MAP.json ARTIFACT
      where it runs: converts the GGUF as kvexport does (or reads an HF folder given in its place)
      and writes ARTIFACT/model.onnx.data back,
      refused unless its sha256 is the exported file's (kvexport.json checks it again on load).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DATA = "model.onnx.data"


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _bytes(tensor: torch.Tensor, transform: str, dtype: str) -> bytes:
    tensor = tensor.T if transform == "T" else tensor
    return tensor.to(getattr(torch, dtype)).contiguous().view(torch.uint8).numpy().tobytes()


def make_map(artifact: Path, converted: Path, out: Path) -> None:
    import onnx

    dtype = json.loads((artifact / "kvexport.json").read_text())["dtype"]
    by_digest = {}
    for name, tensor in _tensors(converted).items():
        for transform in ("id", "T") if tensor.ndim == 2 else ("id",):
            by_digest.setdefault(hashlib.sha256(_bytes(tensor, transform, dtype)).digest(), (name, transform))
    data = (artifact / DATA).read_bytes()
    entries, raw = [], bytearray()
    graph = onnx.load(str(artifact / "model.onnx"), load_external_data=False).graph
    for init in graph.initializer:
        info = {e.key: e.value for e in init.external_data}
        if info:
            offset, length = int(info.get("offset", 0)), int(info["length"])
            hit = by_digest.get(hashlib.sha256(data[offset:offset + length]).digest())
            entries.append({"offset": offset, "length": length, **({"tensor": hit[0], "transform": hit[1]} if hit else {})})
    covered, position = sorted((e["offset"], e["length"]) for e in entries), 0
    for offset, length in [*covered, (len(data), 0)]:  # bytes no initializer lists (a Constant's, say)
        if offset > position:
            entries.append({"offset": position, "length": offset - position})
        position = max(position, offset + length)
    for e in entries:
        if "tensor" not in e:
            e["raw"] = len(raw)
            raw += data[e["offset"]:e["offset"] + e["length"]]
    out.with_suffix(".raw").write_bytes(raw)
    out.write_text(json.dumps({"dtype": dtype, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "entries": entries}))
    print(f"{sum('tensor' in e for e in entries)} ranges from the checkpoint, {len(raw):,} bytes as they are")


def rebuild(model: Path, map_file: Path, artifact: Path) -> None:
    from kvexport.models import sources
    from kvexport.models.gguf_conversion import plain_folder

    source = sources.resolve(str(model))
    tensors = _tensors(plain_folder(source, None) if source.kind in ("alias", "gguf") else source.path)
    spec, raw = json.loads(map_file.read_text()), map_file.with_suffix(".raw").read_bytes()
    data = bytearray(spec["size"])
    for e in spec["entries"]:
        end = e["offset"] + e["length"]
        data[e["offset"]:end] = raw[e["raw"]:e["raw"] + e["length"]] if "raw" in e else \
            _bytes(tensors[e["tensor"]], e["transform"], spec["dtype"])
    digest = hashlib.sha256(data).hexdigest()
    if digest != spec["sha256"]:
        sys.exit(f"{artifact}: the rebuilt {DATA} has sha256 {digest}, the exported one {spec['sha256']}; nothing written")
    (artifact / DATA).write_bytes(data)
    print(f"{artifact / DATA}: sha256 {digest}, as exported")


if __name__ == "__main__":
    command, *args = sys.argv[1:] or ["help"]
    if command == "map" and len(args) == 3:
        make_map(*map(Path, args))
    elif command == "rebuild" and len(args) == 3:
        rebuild(*map(Path, args))
    else:
        sys.exit(__doc__)
