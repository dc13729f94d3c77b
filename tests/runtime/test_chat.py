"""``kvexport chat``: each turn feeds only its new tokens into the cache the conversation keeps, and
replies exactly as a fresh generation over the whole rendered conversation would."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import sys
from dataclasses import replace

import numpy as np
import pytest
from transformers import AutoTokenizer

from kvexport.artifact.manifest import Layer, read_manifest, write_manifest
from kvexport.cli.chat import StopOnCtrlC
from kvexport.errors import PromptTooLongError
from kvexport.models.chat_templates import GEMMA3
from kvexport.models.presets import char_tokenizer
from kvexport.runtime.chat import Conversation
from kvexport.runtime.generation import generate
from kvexport.runtime.programs import load_program
from kvexport.runtime.tokenizer import ArtifactTokenizer

from tests.conftest import TEST_CACHE_LEN
from tests.helpers import assert_one_line_error, fake_manifest, run_cli

# The tiny presets' tokenizer has one token per character, and a 64-position test cache holds
# three short turns only in templates with short markers. These keep the two templates' logic:
# Gemma 3's own (BOS written by the template, the system prompt folded into the first user turn,
# replies trimmed, "model" for the assistant), with its control tokens as one-character "[" and
# the special <pad> as the end of turn (a token apart from EOS); and a ChatML-like one (a system
# turn of its own, every turn closed by the special <eos>).
GEMMA_LIKE = GEMMA3.replace("<start_of_turn>", "[").replace("<end_of_turn>", "<pad>")
CHATML_LIKE = (
    "{% for m in messages %}<|{{ m['role'][0] }}>{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|a>{% endif %}"
)
TEMPLATES = {"gemma-like": GEMMA_LIKE, "chatml-like": CHATML_LIKE}
TURNS = ["A", "B", "C"]
NEW = 3


def with_template(folder, tmp_path, template: str | None):
    """A copy of the artifact whose tokenizer has ``template`` (None: no chat template), its manifest
    rewritten so that the copy verifies."""
    copy = tmp_path / f"{folder.name}-chat"
    shutil.copytree(folder, copy)
    (copy / "chat_template.jinja").unlink()
    if template is not None:
        (copy / "chat_template.jinja").write_text(template)
    manifest = json.loads((copy / "kvexport.json").read_text())
    write_manifest(copy, {k: v for k, v in manifest.items() if k != "files"})
    return copy


def reference_ids(reference, messages) -> list[int]:
    """transformers' own ids for the conversation, ready for the assistant's reply."""
    return list(reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])


class Recorded:
    """The program, with every call's (start, number of tokens)."""

    def __init__(self, program):
        self.program, self.manifest, self.calls = program, program.manifest, []

    def forward(self, tokens, start):
        self.calls.append((start, len(tokens)))
        return self.program.forward(tokens, start)

    def reset(self):
        self.program.reset()


@pytest.mark.parametrize(
    "preset, target, template, system",
    [
        ("tiny-gemma3", "executorch", "gemma-like", "S"),
        ("tiny-gemma3", "onnx", "gemma-like", "S"),
        ("tiny-qwen2", "onnx", "chatml-like", None),
        ("tiny-mistral", "executorch", "chatml-like", "S"),
        # A convolution's state kept across turns (a new conversation starts it over at position 0).
        ("tiny-lfm2", "executorch", "chatml-like", "S"),
        # Layers reading another layer's cache, kept across turns.
        ("tiny-gemma4", "onnx", "gemma-like", None),
        # Linear attention's recurrent state, which cannot be rewound: each turn continues it from where
        # the last call left it (chat never feeds a middle position), its prompt in calls of 64 tokens.
        ("tiny-qwen3.5", "executorch", "chatml-like", "S"),
    ],
)
def test_each_turn_feeds_only_its_new_tokens_and_replies_as_a_fresh_generation(
    artifact, tmp_path, preset, target, template, system
):
    folder = with_template(artifact(preset, target), tmp_path, TEMPLATES[template])
    manifest = read_manifest(folder)
    tokenizer = ArtifactTokenizer(folder)
    reference = AutoTokenizer.from_pretrained(folder)
    program = Recorded(load_program(folder, manifest))
    conversation = Conversation(program, tokenizer, manifest, system=system, max_new_tokens=NEW)
    fresh = load_program(folder, manifest)
    messages = [{"role": "system", "content": system}] if system else []
    cached = 0
    for i, text in enumerate(TURNS):
        messages.append({"role": "user", "content": text})
        expected = reference_ids(reference, messages)
        pieces, program.calls = [], []
        turn = conversation.say(text, on_text=pieces.append)
        # The cache holds transformers' ids of the whole conversation, then the reply (its last token unfed).
        assert turn.prompt_ids == expected
        assert conversation.ids == expected + turn.reply_ids
        assert turn.conversation_tokens == len(expected) + len(turn.reply_ids) - 1
        # Only what is new is fed, from where the cache is: contiguous prefill calls, then one per token.
        assert not turn.reset
        assert turn.prefilled_tokens == len(expected) - cached
        chunk = manifest.max_tokens_per_call
        assert program.calls == [(start, min(chunk, len(expected) - start)) for start in range(cached, len(expected), chunk)] + [
            (position, 1) for position in range(len(expected), turn.conversation_tokens)
        ]
        if i:
            assert 0 < cached < len(expected)
        cached = turn.conversation_tokens
        # The streamed text (DecodeStream) is the reply decoded at once.
        assert "".join(pieces) == tokenizer.decode(turn.reply_ids) == turn.text
        # Exact: a fresh generation from position 0 over the whole rendered conversation replies the same.
        again = generate(fresh, expected, NEW, conversation.stop_ids)
        assert turn.reply_ids == again.new_ids
        assert turn.stopped_by == again.stopped_by
        messages.append({"role": "assistant", "content": turn.text})
    assert conversation.messages == messages


@pytest.mark.parametrize("target", ["executorch", "onnx"])
def test_a_speculative_chat_replies_as_a_plain_one_and_keeps_its_cache_across_turns(artifact, tmp_path, target):
    """``chat --draft``: each reply is the plain conversation's, drafts accepted or rejected, a reply
    stopped by the caller included; the next turn still feeds only its new tokens, and a conversation
    that outgrows the cache starts over as the plain one does."""
    from kvexport.runtime.speculation import PromptLookup

    folder = with_template(artifact("tiny-gemma3", target, max_draft_tokens=4), tmp_path, GEMMA_LIKE)
    manifest = read_manifest(folder)
    tokenizer = ArtifactTokenizer(folder)
    plain = Conversation(load_program(folder, manifest), tokenizer, manifest, system="S", max_new_tokens=8)
    fast = Conversation(load_program(folder, manifest), tokenizer, manifest, system="S", max_new_tokens=8,
                        drafter=PromptLookup())

    def stop_the_second_reply_after_4_tokens(text: str):
        asked = []

        def stop() -> bool:
            asked.append(1)
            return text == "B" and len(asked) > 4

        return stop

    drafted = accepted = 0
    for text in ["A", "B", "C"]:
        want = plain.say(text, stop=stop_the_second_reply_after_4_tokens(text))
        got = fast.say(text, stop=stop_the_second_reply_after_4_tokens(text))
        assert (got.reply_ids, got.text, got.stopped_by) == (want.reply_ids, want.text, want.stopped_by)
        assert got.reset == want.reset and got.prefilled_tokens <= want.prefilled_tokens
        assert fast.ids == plain.ids
        drafted, accepted = drafted + got.speculation["drafted"], accepted + got.speculation["accepted"]
        if text == "B":
            assert got.stopped_by == "caller" and not got.reset  # the second turn fed only its own tokens
    assert 0 < accepted < drafted  # drafts were verified, and some rejected


def test_rejected_drafts_left_in_the_cache_past_a_reply_are_forgotten():
    """What the cache holds past the conversation (a verification's rejected drafts) is dropped from
    its ids, so the next turn's ids still start with them."""
    from kvexport.runtime.chat import _Cache

    class Program:
        def forward(self, tokens, start):
            return np.zeros(3)

        verify = forward

    cache = _Cache(Program(), {})
    cache.forward([1, 2, 3], 0)
    cache.verify([4, 5, 6], 3)  # 4 kept, 5 rejected (the model chose 9), 6 unread
    assert cache.ids == [1, 2, 3, 4, 5, 6]
    cache.keep_prefix_of([1, 2, 3, 4, 9])
    assert cache.ids == [1, 2, 3, 4]
    cache.keep_prefix_of([1, 2, 3, 4, 9, 10])
    assert cache.ids == [1, 2, 3, 4]


def test_a_conversation_that_outgrows_the_cache_starts_over_keeping_the_system_prompt(artifact, tmp_path):
    folder = with_template(artifact("tiny-gemma3", "onnx"), tmp_path, CHATML_LIKE)
    manifest = read_manifest(folder)
    tokenizer = ArtifactTokenizer(folder)
    reference = AutoTokenizer.from_pretrained(folder)
    system = {"role": "system", "content": "Be brief."}
    conversation = Conversation(load_program(folder, manifest), tokenizer, manifest, system="Be brief.", max_new_tokens=8)
    told = []
    turns = [conversation.say(f"Turn {i}", on_notice=told.append) for i in range(4)]
    first_reset = next(i for i, turn in enumerate(turns) if turn.reset)
    assert first_reset >= 2 and not told[1:]
    assert told == [
        f"the conversation no longer fits in the cache ({TEST_CACHE_LEN} positions); it starts over from this turn, "
        "keeping the system prompt"
    ]
    turn = turns[first_reset]
    assert turn.notices == told
    user = {"role": "user", "content": f"Turn {first_reset}"}
    expected = reference_ids(reference, [system, user])
    assert turn.prompt_ids == expected and turn.prefilled_tokens == len(expected)
    assert conversation.messages[:2] == [system, user]
    assert turn.reply_ids == generate(load_program(folder, manifest), expected, 8, conversation.stop_ids).new_ids
    # Never silently wrong: every turn's rendered conversation fitted, with room for its reply.
    assert all(len(t.prompt_ids) + 8 - 1 <= TEST_CACHE_LEN for t in turns)


# The fast tests below run a scripted program over the tiny presets' tokenizer.


class ScriptedProgram:
    """Replies ``reply`` (token ids, then EOS), whatever it is fed; refuses calls that are not
    contiguous or going back as far as its manifest's ``rewind`` (no layers: all full, any
    position), as the runners do; records every call."""

    def __init__(self, reply: list[int], max_cache_len=TEST_CACHE_LEN, vocab=100):
        self.manifest = fake_manifest(max_cache_len=max_cache_len, eos_token_ids=(97,))
        self.reply, self.vocab = reply, vocab
        self.calls: list[tuple[int, int]] = []
        self.fed: list[list[int]] = []
        self.next_start = 0
        self.fail_at: int | None = None  # raise KeyboardInterrupt on the call that reaches this position

    def forward(self, tokens, start):
        assert start == 0 or self.next_start - self.manifest.rewind <= start <= self.next_start, (start, self.next_start)
        if self.fail_at is not None and start + len(tokens) > self.fail_at:
            self.fail_at = None
            raise KeyboardInterrupt
        self.calls.append((start, len(tokens)))
        self.fed.append(list(tokens))
        self.next_start = start + len(tokens)
        # A prefill (several tokens) begins a reply; each one-token call feeds back its last token.
        self.step = 0 if len(tokens) > 1 or start == 0 else self.step + 1
        logits = np.zeros(self.vocab, dtype=np.float32)
        logits[self.reply[self.step] if self.step < len(self.reply) else 97] = 1.0
        return logits

    def reset(self):
        self.next_start = 0


def scripted_tokenizer(tmp_path, template):
    tok = char_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(tmp_path)
    return ArtifactTokenizer(tmp_path), tok


def char_ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_end_of_turn_token_a_reply_stops_at_is_fed_first_in_the_next_turn(tmp_path):
    """generate() never feeds a reply's last token; the template renders it (here EOS closes every
    turn), so the next turn's new tokens begin with it, fed at the position after the reply."""
    tokenizer, reference = scripted_tokenizer(tmp_path, CHATML_LIKE)
    program = ScriptedProgram(char_ids(tokenizer, "abc"))
    conversation = Conversation(program, tokenizer)
    first = conversation.say("Hi")
    assert first.reply_ids == [*char_ids(tokenizer, "abc"), 97] and first.stopped_by == "eos" and first.text == "abc"
    assert first.conversation_tokens == len(first.prompt_ids) + 3
    program.calls, program.fed = [], []
    second = conversation.say("Go")
    assert second.prompt_ids == reference_ids(reference, [{"role": "user", "content": "Hi"},
                                                          {"role": "assistant", "content": "abc"},
                                                          {"role": "user", "content": "Go"}])
    assert program.calls[0] == (first.conversation_tokens, second.prefilled_tokens)
    assert program.fed[0][0] == 97 and not second.reset


def test_a_template_that_renders_the_history_differently_starts_over_at_position_zero(tmp_path):
    """Gemma's template trims a reply: one ending in a space re-renders without it, so the ids no
    longer start with the cache's, and a program with a ring, which cannot go back to where they
    part, is fed the whole conversation again from position 0."""
    tokenizer, _ = scripted_tokenizer(tmp_path, GEMMA_LIKE)
    program = ScriptedProgram(char_ids(tokenizer, "ok "))
    program.manifest = replace(program.manifest, layers=(Layer(0, "sliding_attention", "ring", window=8, slots=8),))
    conversation = Conversation(program, tokenizer, max_new_tokens=5)
    first = conversation.say("Hi")
    assert first.text == "ok " and first.stopped_by == "eos"
    program.calls = []
    second = conversation.say("Hi")
    assert second.reset and second.prefilled_tokens == len(second.prompt_ids)
    assert program.calls[0] == (0, len(second.prompt_ids))
    assert second.notices == []  # nothing was dropped: no need to tell the user


def test_a_program_of_full_layers_goes_back_to_where_a_re_rendered_history_parts(tmp_path):
    """The same re-rendered reply with a program whose layers are all full ones (its manifest's
    ``rewind`` reaches any position): the next turn starts where the ids part from the cache's,
    feeding only what follows, as one from position 0 would have been fed past that point."""
    tokenizer, reference = scripted_tokenizer(tmp_path, GEMMA_LIKE)
    program = ScriptedProgram(char_ids(tokenizer, "ok "))
    program.manifest = replace(program.manifest, layers=(Layer(0, "full_attention", "static"),))
    conversation = Conversation(program, tokenizer, max_new_tokens=5)
    first = conversation.say("Hi")
    cached = conversation.ids[: first.conversation_tokens]
    program.calls, program.fed = [], []
    second = conversation.say("Hi")
    part = next(i for i, (a, b) in enumerate(zip(cached, second.prompt_ids)) if a != b)
    assert 0 < part < first.conversation_tokens and not second.reset
    assert program.calls[0] == (part, len(second.prompt_ids) - part) and second.prefilled_tokens == len(second.prompt_ids) - part
    assert program.fed[0] == second.prompt_ids[part:]


def test_a_reply_stopped_by_the_caller_keeps_its_text_and_the_next_turn_goes_on(tmp_path):
    tokenizer, reference = scripted_tokenizer(tmp_path, CHATML_LIKE)
    program = ScriptedProgram(char_ids(tokenizer, "abcdef"))
    conversation = Conversation(program, tokenizer)
    pieces = []
    turn = conversation.say("Hi", on_text=pieces.append, stop=lambda: len(pieces) >= 2)
    assert turn.stopped_by == "caller" and turn.text == "ab" == "".join(pieces)
    assert conversation.ids == turn.prompt_ids + turn.reply_ids  # both reply tokens were fed
    assert turn.conversation_tokens == len(conversation.ids)
    nothing = conversation.say("Hi", stop=lambda: True)  # Ctrl-C during the prefill: an empty reply
    assert nothing.reply_ids == [] and nothing.text == ""
    program.calls = []
    after = conversation.say("Go")
    assert not after.reset and program.calls[0][0] == nothing.conversation_tokens
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ab"},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "Go"}]
    assert after.prompt_ids == reference_ids(reference, messages)


def test_a_failed_call_makes_the_next_turn_start_over(tmp_path):
    tokenizer, _ = scripted_tokenizer(tmp_path, CHATML_LIKE)
    program = ScriptedProgram(char_ids(tokenizer, "abc"))
    conversation = Conversation(program, tokenizer)
    first = conversation.say("Hi")
    prompt = len(tokenizer.encode_chat([*first_messages(first), {"role": "user", "content": "More"}]))
    program.fail_at = prompt + 1  # the reply's second token
    with pytest.raises(KeyboardInterrupt):
        conversation.say("More")
    assert conversation.ids == [] and conversation.messages == first_messages(first)
    program.calls = []
    again = conversation.say("More")
    assert again.reset and program.calls[0] == (0, len(again.prompt_ids))


def first_messages(turn):
    return [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": turn.text}]


def test_a_reply_that_fills_the_cache_is_cut_and_said(tmp_path):
    tokenizer, _ = scripted_tokenizer(tmp_path, CHATML_LIKE)
    program = ScriptedProgram(char_ids(tokenizer, "x" * 100))
    conversation = Conversation(program, tokenizer)
    turn = conversation.say("Hi")
    assert turn.stopped_by == "max_cache_len" and turn.conversation_tokens == TEST_CACHE_LEN
    assert turn.notices == [f"the reply filled the cache ({TEST_CACHE_LEN} positions) and was cut; the next turn starts over"]
    assert conversation.say("Hi").reset


def test_a_turn_that_cannot_fit_even_alone_is_refused_and_the_conversation_is_kept(tmp_path):
    tokenizer, _ = scripted_tokenizer(tmp_path, CHATML_LIKE)
    conversation = Conversation(ScriptedProgram(char_ids(tokenizer, "abc")), tokenizer, max_new_tokens=4)
    conversation.say("Hi")
    ids, messages = conversation.ids, conversation.messages
    with pytest.raises(PromptTooLongError, match="this turn is 75 tokens in the chat template, more than the artifact's max_cache_len 64"):
        conversation.say("y" * 65)
    with pytest.raises(PromptTooLongError, match="with --max-new-tokens 4 it exceeds .* ask for at most 2 new tokens"):
        conversation.say("y" * 53)
    assert conversation.ids == ids and conversation.messages == messages
    assert not conversation.say("Go").reset


def test_streamed_text_is_the_decoded_reply_even_across_multibyte_characters(tmp_path):
    """Byte-level tokens: a character of two or three bytes is two or three tokens, and the stream
    writes it once it is whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(byte_level))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = ArtifactTokenizer(tmp_path)
    text = "née ✓ 𝄞 ok"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)
    step = tokenizer.decode_stream()
    pieces = [step(i) for i in ids]
    assert None in pieces or "" in pieces  # an incomplete character waits
    assert "".join(p for p in pieces if p) == tokenizer.decode(ids) == text


@pytest.mark.usefixtures("sigint_raises_keyboard_interrupt")
def test_ctrl_c_during_a_reply_only_asks_it_to_stop():
    previous = signal.getsignal(signal.SIGINT)
    with StopOnCtrlC() as stop:
        assert not stop()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop()
    assert signal.getsignal(signal.SIGINT) is previous


# The command line.


def chat_cli(capsys, monkeypatch, stdin: str, *args):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    return run_cli(capsys, "chat", *args)


def test_chat_json_prints_one_object_per_turn_with_the_system_prompt_and_reset(artifact, capsys, monkeypatch):
    folder = artifact("tiny-gemma3", "onnx")  # the presets' own template: "<role>content\n"
    reference = AutoTokenizer.from_pretrained(folder)
    code, out, err = chat_cli(capsys, monkeypatch, "Hi\nYo\n/reset\n\nHi\n", folder, "--json", "--system", "Be.",
                              "--max-new-tokens", "3")
    assert code == 0, err
    turns = [json.loads(line) for line in out.splitlines()]
    assert len(turns) == 3
    assert set(turns[0]) == {"reply_ids", "text", "prefilled_tokens", "conversation_tokens", "reset", "stopped_by",
                             "prefill_tokens_per_s", "decode_tokens_per_s"}
    system, hi = {"role": "system", "content": "Be."}, {"role": "user", "content": "Hi"}
    expected = reference_ids(reference, [system, hi])
    assert reference.decode(expected).startswith("<system>Be.\n")  # the system text is in the rendered prompt
    assert turns[0]["prefilled_tokens"] == len(expected)
    assert turns[0]["reply_ids"] == generate(load_program(folder), expected, 3, {97}).new_ids
    assert turns[0]["text"] == reference.decode(turns[0]["reply_ids"], skip_special_tokens=True)
    second = reference_ids(reference, [system, hi, {"role": "assistant", "content": turns[0]["text"]},
                                       {"role": "user", "content": "Yo"}])
    assert turns[1]["prefilled_tokens"] == len(second) - turns[0]["conversation_tokens"]
    assert not any(t["reset"] for t in turns)
    assert turns[2] == {**turns[0], "prefill_tokens_per_s": turns[2]["prefill_tokens_per_s"],
                        "decode_tokens_per_s": turns[2]["decode_tokens_per_s"]}  # /reset: the first turn again
    assert err == ""


def test_chat_draft_reports_each_turns_speculation_and_the_plain_replies(artifact, capsys, monkeypatch):
    folder = artifact("tiny-gemma3", "executorch", max_draft_tokens=4)
    turns = {}
    for args in ([], ["--draft", "ngram", "--draft-tokens", "2"]):
        code, out, err = chat_cli(capsys, monkeypatch, "Hi\nYo\n", folder, "--json", "--max-new-tokens", "6", *args)
        assert code == 0, err
        turns[bool(args)] = [json.loads(line) for line in out.splitlines()]
    assert [t["reply_ids"] for t in turns[True]] == [t["reply_ids"] for t in turns[False]]
    assert all(t["speculation"]["draft_tokens"] == 2 for t in turns[True])
    assert not any("speculation" in t for t in turns[False])


def test_chat_streams_text_and_says_in_one_line_when_it_starts_over(artifact, capsys, monkeypatch):
    folder = artifact("tiny-gemma3", "onnx")
    code, out, err = chat_cli(capsys, monkeypatch, "".join(f"Turn {i}\n" for i in range(4)), folder,
                              "--max-new-tokens", "8")
    assert code == 0, err
    assert out.endswith("\n") and "{" not in out
    notices = err.strip().splitlines()
    assert notices and all(line.startswith("kvexport: the conversation no longer fits in the cache (64 positions)")
                           for line in notices)


def test_chat_refuses_a_turn_that_cannot_fit_and_goes_on(artifact, capsys, monkeypatch):
    folder = artifact("tiny-gemma3", "onnx")
    code, out, err = chat_cli(capsys, monkeypatch, "x" * 80 + "\nHi\n", folder, "--json", "--max-new-tokens", "2")
    assert_one_line_error(code, err, "this turn is 98 tokens in the chat template", "max_cache_len 64")
    assert len(out.splitlines()) == 1  # the next turn got its reply


def test_chat_refuses_a_line_that_is_not_utf8_and_goes_on(artifact, capsys, monkeypatch):
    """Issue 58, class 5: stdin's bytes as they come (a TextIOWrapper, as sys.stdin is); a line that
    is not UTF-8 was a UnicodeDecodeError traceback ending the chat."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ab\xffcd\nHi\n"), encoding="utf-8"))
    code, out, err = run_cli(capsys, "chat", artifact("tiny-gemma3", "onnx"), "--json", "--max-new-tokens", "2")
    assert_one_line_error(code, err, "the text is not valid UTF-8 (the byte 0xff at character 2)")
    assert len(out.splitlines()) == 1  # the next turn got its reply


def test_chat_needs_a_chat_template(artifact, tmp_path, capsys, monkeypatch):
    folder = with_template(artifact("tiny-gemma3", "onnx"), tmp_path, None)
    code, _, err = chat_cli(capsys, monkeypatch, "Hi\n", folder)
    assert_one_line_error(code, err, "no chat template, so it cannot chat", "kvexport run")


@pytest.mark.parametrize(
    "args, phrases",
    [(["--max-new-tokens", "0"], ["--max-new-tokens must be at least 1, got 0"]),
     (["--temperature", "-1"], ["temperature must be"]),
     (["--draft", "ngram", "--temperature", "0.7"], ["--draft decodes greedily", "leave out --temperature"]),
     (["--draft", "ngram"], ["this artifact does not verify drafted tokens", "--max-draft-tokens"])],
    ids=["max-new-tokens-zero", "negative-temperature", "draft-sampling", "draft-without-verification"],
)
def test_chat_option_mistakes_get_one_line(artifact, capsys, monkeypatch, args, phrases):
    code, _, err = chat_cli(capsys, monkeypatch, "Hi\n", artifact("tiny-gemma3", "onnx"), *args)
    assert_one_line_error(code, err, *phrases)


@pytest.mark.usefixtures("sigint_raises_keyboard_interrupt")
def test_chat_ctrl_c_during_a_reply_stops_that_reply_and_the_conversation_goes_on(artifact, capsys, monkeypatch):
    from kvexport.runtime import programs

    load = programs.load_program
    calls = []

    def interrupted_at_the_third_call(*args, **kwargs):
        program = load(*args, **kwargs)
        forward = program.forward

        def forward_then_ctrl_c(tokens, start):
            calls.append(start)
            logits = forward(tokens, start)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the first reply is generated
            return logits

        program.forward = forward_then_ctrl_c
        return program

    monkeypatch.setattr(programs, "load_program", interrupted_at_the_third_call)
    code, out, err = chat_cli(capsys, monkeypatch, "Hi\nYo\n", artifact("tiny-gemma3", "onnx"), "--json", "--max-new-tokens", "6")
    assert code == 0, err
    first, second = [json.loads(line) for line in out.splitlines()]
    assert first["stopped_by"] == "caller" and len(first["reply_ids"]) == 2  # kept, both fed
    assert second["stopped_by"] == "max_new_tokens" and not second["reset"]
    assert second["conversation_tokens"] - second["prefilled_tokens"] - 5 == first["conversation_tokens"]
    assert err == ""  # --json: stopped_by says it
