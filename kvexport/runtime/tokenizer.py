"""The artifact's tokenizer, read with the ``tokenizers`` library alone (no torch, no transformers).

``tokenizer.json`` carries its own post-processor, so ``encode`` gives the ids transformers'
tokenizer gives (BOS included where the model wants it).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ..errors import ArtifactError, KvexportError


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_stream(self):
        """A function of the next token id that returns the text it completes (``""`` or ``None``
        where none yet: a multi-byte character spans tokens). The texts add up to ``decode`` of all
        the ids; each step decodes only a few trailing tokens (``tokenizers``' ``DecodeStream``)."""
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=True)
        return lambda token: stream.step(self._tok, token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered with the model's own chat template the way
        transformers renders it (a sandboxed jinja2 environment, the tokenizer's special tokens)."""
        if not self.chat_template:
            raise ArtifactError("this model's tokenizer has no chat template; use a plain prompt")
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise KvexportError("chat templates need jinja2 (pip install jinja2); or use a plain prompt")

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # jinja2's own tojson escapes HTML characters; templates expect plain JSON.
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        # Chat templates are untrusted code: the sandbox keeps them from reaching Python internals.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        specials = {k: v for k, v in self.config.items() if k.endswith("_token") and isinstance(v, str)}
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **specials
            )
        except jinja2.TemplateError as e:
            raise ArtifactError(f"the model's chat template refused the conversation: {e}")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation ready for the model's reply. The template writes every special
        token the model wants (BOS included), so encoding adds none, as transformers'
        ``apply_chat_template(tokenize=True)`` does: BOS is neither doubled nor dropped."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def turn_end_ids(self) -> list[int]:
        """The special token the chat template closes a reply with (Gemma's ``<end_of_turn>``, ChatML's
        ``<|im_end|>``), found by rendering a reply: a chat stops there even where the model's EOS
        is another token. Empty when the template ends a reply with plain text."""
        marker = "kvexport-reply-marker"
        conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
        try:
            text = self.apply_chat_template(conversation, add_generation_prompt=False)
        except ArtifactError:  # a template that refuses this conversation marks no turn end we can find
            return []
        if marker not in text:
            return []
        ids = self.encode(text.split(marker, 1)[1], add_special_tokens=False)
        special = {i for i, token in self._tok.get_added_tokens_decoder().items() if token.special}
        return ids[:1] if ids and ids[0] in special else []
