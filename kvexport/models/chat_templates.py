"""Chat templates for models whose files carry none.

Gemma 3 270M as a GGUF (the ``gemma3-270m`` alias) has no ``tokenizer.chat_template`` key, so
transformers gives its tokenizer no template. Gemma 3's turn format is fixed by control tokens
that are in every Gemma 3 vocabulary, this one included (``<start_of_turn>``, ``<end_of_turn>``),
and it is the same for all Gemma 3 text models: the template below renders text conversations
exactly as the one in Google's Gemma 3 tokenizer files does (a system message is folded into the
first user turn; the assistant's role is ``model``). It is used only for ``gemma3_text`` models
without a template of their own. The 270M base model was not instruction-tuned, so its replies
are a base model's.
"""

from __future__ import annotations

GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

_FALLBACKS = {"gemma3_text": (GEMMA3, "<start_of_turn>")}


def fallback_chat_template(model_type: str, vocab: dict[str, int]) -> str | None:
    """The template for a model of ``model_type`` that has none, if its vocabulary has the template's
    control tokens; None otherwise."""
    template, control_token = _FALLBACKS.get(model_type, (None, None))
    return template if template and control_token in vocab else None
