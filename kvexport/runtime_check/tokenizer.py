"""The artifact's tokenizer, read with the ``tokenizers`` library alone (no torch, no transformers).

``tokenizer.json`` carries its own post-processor, so ``encode`` gives the ids transformers'
tokenizer gives (BOS included where the model wants it).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ArtifactError


class ArtifactTokenizer:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ArtifactError(f"{folder} has no tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = folder / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else self.config.get("chat_template")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt text for a conversation, rendered with the model's own chat template."""
        if not self.chat_template:
            raise ArtifactError("this model's tokenizer has no chat template; use a plain prompt")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        specials = {k: v for k, v in self.config.items() if k.endswith("_token") and isinstance(v, str)}
        text = env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True, **specials)
        # The template writes BOS itself where the model wants it; encode() would add a second one.
        bos = self.config.get("bos_token")
        if isinstance(bos, str) and text.startswith(bos):
            text = text[len(bos):]
        return text
