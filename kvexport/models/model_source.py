"""A resolved MODEL argument (``ModelSource``), which each way of getting a model takes or returns."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..artifact.manifest import Source


@dataclass(frozen=True)
class ModelSource:
    """A resolved MODEL argument."""

    name: str  # what the user gave
    kind: str  # "preset", "alias", "folder", "gguf" or "hub"
    path: Path | None = None  # folder, or the .gguf file
    # From the Hugging Face Hub (a hub id, or a .gguf file in a hub repo): what was asked for and the
    # commit it named, so an artifact says exactly what it came from.
    revision: str | None = None
    commit: str | None = None
    gguf_file: str | None = None  # the .gguf file's path in the repo (--gguf-file)

    def describe(self) -> Source:
        """What an artifact's manifest records of it."""
        return Source(self.name, self.kind, str(self.path) if self.path else None, self.revision, self.commit, self.gguf_file)

    @property
    def label(self) -> str:
        """How messages name it."""
        return f"{self.gguf_file} of {self.name}" if self.gguf_file else self.name
