"""An ONNX graph's weights read one at a time from its external data file, and a new data file
written one tensor at a time: a rewrite of the weights (``--quantize int4``) holds one weight in
memory, not the model (``onnx.load(load_external_data=True)`` reads them all, and ``onnx.save_model``
writes from memory).

A tensor is stored in the data file when it has at least ``INLINE_MAX_BYTES`` bytes, as
``onnx.save_model`` does, and inline in the graph otherwise."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

INLINE_MAX_BYTES = 1024


class Weights:
    """The initializers of a graph loaded with ``load_external_data=False``, as arrays read on demand."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def array(self, tensor) -> np.ndarray:
        from onnx import helper, numpy_helper
        from onnx.external_data_helper import ExternalDataInfo, uses_external_data

        if not uses_external_data(tensor):
            return numpy_helper.to_array(tensor)
        info = ExternalDataInfo(tensor)
        with open(self.folder / info.location, "rb") as f:
            f.seek(info.offset or 0)
            data = f.read(info.length) if info.length is not None else f.read()
        return np.frombuffer(data, helper.tensor_dtype_to_np_dtype(tensor.data_type)).reshape(tuple(tensor.dims))


class DataFileWriter:
    """Appends tensors to a new external data file ``path`` (for a graph that names it ``location``)
    as they are made, returning the initializer that points at each."""

    def __init__(self, path: Path, location: str):
        self.path, self.location = Path(path), location
        self.file = open(path, "wb")

    def add(self, array: np.ndarray, name: str):
        """The initializer ``name`` of ``array``: its bytes written to the file, or inline where few.
        A written tensor's initializer never holds its bytes: protobuf keeps a message's bytes in
        its arena until the message goes, even after ``ClearField``, so the new graph's initializers
        would hold every weight written (the whole artifact) until it is saved."""
        from onnx import TensorProto, helper, numpy_helper
        from onnx.external_data_helper import set_external_data

        array = np.ascontiguousarray(array)
        if array.nbytes < INLINE_MAX_BYTES:
            return numpy_helper.from_array(array, name)
        offset = self.file.tell()
        self.file.write(memoryview(array).cast("B"))
        tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape, raw_data=b"")
        set_external_data(tensor, self.location, offset, array.nbytes)
        tensor.ClearField("raw_data")
        return tensor

    def close(self) -> None:
        self.file.close()

    def replace(self, old: Path, mode_of: Path) -> None:
        """Close, and put the new file in ``old``'s place, with ``mode_of``'s permissions (the graph
        beside it)."""
        self.close()
        shutil.copymode(mode_of, self.path)
        os.replace(self.path, old)
