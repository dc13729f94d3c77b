"""The artifact's tokenizer, read with the ``tokenizers`` library alone (no torch, no transformers).

``tokenizer.json`` carries its own post-processor, so ``encode`` gives the ids transformers'
tokenizer gives (BOS included where the model wants it).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ..artifact.manifest import MANIFEST, Manifest, read_listed_file, read_manifest
from ..errors import ArtifactError, InvalidOptionError, KvexportError, first_line

_DAMAGED = "the artifact is damaged, re-run kvexport export"



def _named_template(template):
    """The chat template of ``tokenizer_config.json``: a text, or (older transformers) a list of
    named ones, of which the ``default`` one is used."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template


class ArtifactTokenizer:
    def __init__(self, folder: Path, manifest: Manifest | None = None):
        """In an artifact, reads only the files ``kvexport.json`` lists, each checked against its sha256
        as it is read (``manifest``: the folder's, already read; by default it is read here). A folder
        without ``kvexport.json`` is a plain tokenizer folder (``save_pretrained``'s), read as it is."""
        from tokenizers import Tokenizer

        folder = Path(folder)
        if manifest is None and ((folder / MANIFEST).exists() or (folder / MANIFEST).is_symlink()):
            manifest = read_manifest(folder, verify=False)

        def text(name: str) -> str | None:
            if manifest is not None:
                data = read_listed_file(folder, manifest, name)
            else:
                data = (folder / name).read_bytes() if (folder / name).is_file() else None
            try:
                return None if data is None else data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ArtifactError(f"{folder / name} is not UTF-8 text ({e.reason} at byte {e.start}); {_DAMAGED}")

        tokenizer = text("tokenizer.json")
        if tokenizer is None:
            raise ArtifactError(
                f"{folder / MANIFEST} does not list tokenizer.json among its files; {_DAMAGED}"
                if manifest is not None
                else f"{folder} has no tokenizer.json"
            )
        try:
            self._tok = Tokenizer.from_str(tokenizer)
        except Exception as e:  # tokenizers raises a bare Exception for any file it cannot parse
            raise ArtifactError(f"{folder / 'tokenizer.json'} is not a tokenizer the tokenizers library reads ({first_line(e)[:200]}); {_DAMAGED}")
        if manifest is not None:
            self._check_vocabulary(folder, manifest.vocab_size)
        config = text("tokenizer_config.json")
        try:
            self.config = {} if config is None else json.loads(config)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ArtifactError(f"{folder / 'tokenizer_config.json'} is not valid JSON ({first_line(e)[:200]}); {_DAMAGED}")
        if not isinstance(self.config, dict):
            raise ArtifactError(f"{folder / 'tokenizer_config.json'} is not a JSON object; {_DAMAGED}")
        template = text("chat_template.jinja")
        self.chat_template = template if template is not None else _named_template(self.config.get("chat_template"))
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ArtifactError(f"{folder / 'tokenizer_config.json'}: its chat_template is not a template; {_DAMAGED}")

    def _check_vocabulary(self, folder: Path, vocab_size: int) -> None:
        """Refuse a tokenizer that can give an id the program has no row for (its vocabulary, added
        tokens and the ids its post-processor adds, BOS and EOS): the runtime would fail on the
        embedding's lookup mid-generation. A model's vocabulary may be larger than its tokenizer's."""
        try:
            ids = [*self._tok.get_vocab(with_added_tokens=True).values(), *self._tok.encode("", add_special_tokens=True).ids]
        except Exception as e:  # a post-processor that names a token the vocabulary lacks
            raise ArtifactError(f"{folder / 'tokenizer.json'} is not a tokenizer the tokenizers library reads ({first_line(e)[:200]}); {_DAMAGED}")
        if ids and max(ids) >= vocab_size:
            raise ArtifactError(
                f"{folder / 'tokenizer.json'} gives token id {max(ids)}, outside the vocabulary of {vocab_size} tokens "
                f"{MANIFEST} says the program has; the tokenizer or the manifest was edited or damaged, re-run kvexport export"
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_utf8(text)
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


def check_utf8(text: str) -> None:
    """Refuse text that is not Unicode: bytes that were not UTF-8 (a command line or stdin decoded
    with ``surrogateescape`` keeps them as lone surrogates), which no tokenizer can encode. Replacing
    them would tokenize something other than what the user gave."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        try:
            what = f"the byte 0x{bad.encode('utf-8', 'surrogateescape')[0]:02x}"
        except UnicodeEncodeError:
            what = f"a lone surrogate U+{ord(bad):04X}"
        raise InvalidOptionError(f"the text is not valid UTF-8 ({what} at character {e.start}); give it as UTF-8")

