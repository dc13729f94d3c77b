"""The artifact tokenizer's chat: the ids transformers' apply_chat_template gives, and where a reply ends."""

from __future__ import annotations

import pytest

from hypothesis import given
from hypothesis import strategies as st

from kvexport.errors import ArtifactError, InvalidOptionError
from kvexport.models import sources
from kvexport.models.chat_templates import GEMMA3
from kvexport.models.presets import build_preset
from kvexport.runtime.tokenizer import ArtifactTokenizer, check_utf8

CONVERSATIONS = [
    [{"role": "user", "content": "  What is 2 + 2? "}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a color."},
    ],
]


def saved_tokenizer(folder, chat_template="preset", turn_tokens=False):
    """The tiny presets' tokenizer (it prepends <bos> when encoding), saved like an artifact's."""
    _, tokenizer = build_preset("tiny-gemma3")
    if turn_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    if chat_template != "preset":
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return tokenizer


@pytest.mark.parametrize("template", ["preset", GEMMA3], ids=["template-without-bos", "gemma3-writes-bos"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "with-system-and-history"])
def test_chat_ids_are_transformers_ids(tmp_path, template, messages):
    """BOS is neither doubled (the template writes it, encoding adds none) nor added where the template has none."""
    reference = saved_tokenizer(tmp_path, template, turn_tokens=True)
    expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    ids = ArtifactTokenizer(tmp_path).encode_chat(messages)
    assert ids == expected
    bos = reference.bos_token_id
    assert ids.count(bos) == (1 if template == GEMMA3 else 0)


def test_a_reply_ends_at_the_templates_end_of_turn_token(tmp_path):
    reference = saved_tokenizer(tmp_path, GEMMA3, turn_tokens=True)
    assert ArtifactTokenizer(tmp_path).turn_end_ids() == [reference.convert_tokens_to_ids("<end_of_turn>")]


def test_no_turn_end_token_where_the_template_ends_a_reply_with_text(tmp_path):
    saved_tokenizer(tmp_path)  # the presets' template closes a turn with "\n"
    assert ArtifactTokenizer(tmp_path).turn_end_ids() == []


def test_template_errors_and_a_missing_template_are_artifact_errors(tmp_path):
    saved_tokenizer(tmp_path, GEMMA3, turn_tokens=True)
    with pytest.raises(ArtifactError, match="refused the conversation: Conversation roles must alternate"):
        ArtifactTokenizer(tmp_path).encode_chat([{"role": "assistant", "content": "x"}])
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ArtifactError, match="no chat template"):
        ArtifactTokenizer(tmp_path).encode_chat(CONVERSATIONS[0])


def test_the_template_cannot_reach_python_internals(tmp_path):
    saved_tokenizer(tmp_path, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ArtifactError, match="refused the conversation"):
        ArtifactTokenizer(tmp_path).encode_chat(CONVERSATIONS[0])


@pytest.mark.parametrize("turn_tokens, expected", [(True, GEMMA3), (False, None)])
def test_a_gemma3_model_without_a_template_gets_gemmas(tmp_path, turn_tokens, expected):
    """Gemma 3 270M's GGUF has no chat template; a gemma3_text model whose vocabulary has Gemma's turn
    tokens gets Gemma 3's, and the export saves it."""
    model, _ = build_preset("tiny-gemma3")
    model.save_pretrained(tmp_path)
    saved_tokenizer(tmp_path, None, turn_tokens)
    _, tokenizer = sources.load_model(sources.resolve(str(tmp_path)))
    assert tokenizer.chat_template == expected


@given(st.binary(max_size=24))
def test_text_from_any_bytes_is_utf8_or_refused_in_one_line(data):
    """Issue 58, class 5: a command line or stdin decoded with surrogateescape (Python's way with
    bytes that are not UTF-8) reaches the tokenizer as lone surrogates; they are refused in one line
    that names the first bad byte, and valid UTF-8 passes."""
    text = data.decode("utf-8", "surrogateescape")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        with pytest.raises(InvalidOptionError, match=f"the byte 0x{data[e.start]:02x} at character "):
            check_utf8(text)
    else:
        check_utf8(text)
