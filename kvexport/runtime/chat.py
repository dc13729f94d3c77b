"""A conversation with an artifact (``kvexport chat``): each turn feeds the program only the tokens
that are new since the last one, the cache kept across turns.

Each turn renders the whole conversation with the model's chat template (as transformers'
``apply_chat_template`` does); where those ids start with the ids the cache holds, only the rest
is fed, from the position the cache is at. Where they do not (a template that renders earlier
turns differently once a reply follows, a reply that re-encodes to other ids), the cache starts
over at position 0 with all of them: calls are never rewound to a middle position, which the
sliding-window ring caches could not follow. A conversation that no longer fits in the cache starts
over with the system prompt and the new turn, and says so.

With a drafter (``--draft``) each reply is decoded speculatively (``speculation``), greedy, the
same tokens; the drafter sees the whole conversation. A verification leaves rejected drafts in the
cache past the reply; the next turn starts where the reply's tokens end, which the artifact's
``max_draft_tokens`` allows.

numpy and tokenizers only (no torch), like the rest of the runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..artifact.manifest import Manifest
from ..errors import ArtifactError, InvalidOptionError, PromptTooLongError
from .generation import Sampling, generate
from .speculation import check_drafter, common_prefix_length, generate_with_draft
from .tokenizer import ArtifactTokenizer, check_utf8


@dataclass
class Turn:
    """One reply. ``prompt_ids``: the whole conversation rendered for it (what the cache held when
    it began); ``prefilled_tokens``: how many of those this turn fed; ``conversation_tokens``: the
    positions in the cache after it; ``reset``: the cache started over at position 0 this turn
    although the conversation had an earlier turn (``notices`` say so where that turn was dropped)."""

    text: str
    reply_ids: list[int]
    prompt_ids: list[int]
    prefilled_tokens: int
    conversation_tokens: int
    reset: bool
    stopped_by: str  # "eos" (EOS or the template's end of turn), "max_new_tokens", "max_cache_len", "caller"
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    notices: list[str] = field(default_factory=list)
    speculation: dict | None = None  # with a drafter: verifications, tokens drafted and accepted

    def summary(self) -> dict:
        """``kvexport chat --json``'s object for the turn."""
        return {
            **({"speculation": self.speculation} if self.speculation else {}),
            "reply_ids": self.reply_ids,
            "text": self.text,
            "prefilled_tokens": self.prefilled_tokens,
            "conversation_tokens": self.conversation_tokens,
            "reset": self.reset,
            "stopped_by": self.stopped_by,
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
        }


class _Cache:
    """The program, and the ids its cache holds at positions ``0 ..`` (what the calls fed)."""

    def __init__(self, program, manifest: Manifest):
        self.program = program
        self.manifest = manifest
        self.ids: list[int] = []

    def forward(self, tokens: list[int], start: int):
        return self._call(self.program.forward, tokens, start)

    def verify(self, tokens: list[int], start: int):
        return self._call(self.program.verify, tokens, start)

    def _call(self, method, tokens: list[int], start: int):
        kept = self.ids[:start]
        self.ids = []  # unknown while the call runs: if it fails, the next turn starts over
        logits = method(tokens, start)
        self.ids = kept + list(tokens)
        return logits

    def keep_prefix_of(self, ids: list[int]) -> None:
        """Forget what the cache holds past its common prefix with ``ids`` (a verification's
        rejected drafts), so that the next turn's ids match what it holds."""
        del self.ids[common_prefix_length(self.ids, ids):]

    def clear(self) -> None:
        self.ids = []
        self.program.reset()


def require_chat_template(tokenizer: ArtifactTokenizer) -> None:
    if not tokenizer.chat_template:
        raise ArtifactError("this model's tokenizer has no chat template, so it cannot chat; use kvexport run with a plain prompt")


class Conversation:
    """A chat with a loaded program: ``say(text)`` for each user turn, ``reset()`` to start over.

    ``sampling``: one for the whole conversation (its seeded generator runs on across turns);
    ``max_new_tokens``: the most tokens a reply takes (``None``: until EOS, the template's end of
    turn, or the cache is full); ``drafter`` (``speculation``; greedy only): replies decoded
    speculatively, ``draft_tokens`` at a time (default: the artifact's ``max_draft_tokens``).
    """

    def __init__(self, program, tokenizer: ArtifactTokenizer, manifest: Manifest | None = None, system: str | None = None,
                 sampling: Sampling | None = None, max_new_tokens: int | None = None, drafter=None,
                 draft_tokens: int | None = None):
        if max_new_tokens is not None and max_new_tokens < 1:
            raise InvalidOptionError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
        require_chat_template(tokenizer)
        if drafter is not None:
            if sampling is not None and sampling.temperature:
                raise InvalidOptionError("--draft decodes greedily: leave out --temperature")
            draft_tokens = check_drafter(program, drafter, draft_tokens)
        self.drafter, self.draft_tokens = drafter, draft_tokens
        self.manifest = manifest or program.manifest
        self.tokenizer = tokenizer
        self.system = system
        self.sampling = sampling or Sampling()
        self.max_new_tokens = max_new_tokens
        self.max_cache_len = self.manifest.max_cache_len
        # A reply ends at EOS or at the template's end of turn (Gemma: <end_of_turn>), as `run --chat`.
        self.stop_ids = set(self.manifest.eos_token_ids) | set(tokenizer.turn_end_ids())
        self._cache = _Cache(program, self.manifest)
        self._unfed: list[int] = []  # the last reply's last token: generated, never fed
        self.messages: list[dict] = []
        self.reset()

    @property
    def ids(self) -> list[int]:
        """The conversation so far as the model saw and wrote it: the ids in the cache, then the last
        reply's tokens that were not fed (its last one)."""
        return self._cache.ids + self._unfed

    @property
    def cached_tokens(self) -> int:
        return len(self._cache.ids)

    def _first_messages(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def reset(self) -> None:
        """Start over: the system prompt alone."""
        self.messages = self._first_messages()
        self._unfed = []
        self._cache.clear()

    def _fits(self, n: int) -> bool:
        return n <= self.max_cache_len and (self.max_new_tokens is None or n + self.max_new_tokens - 1 <= self.max_cache_len)

    def _too_long(self, n: int) -> PromptTooLongError:
        what = f"this turn is {n} tokens in the chat template{' with the system prompt' if self.system else ''}"
        if n > self.max_cache_len:
            return PromptTooLongError(
                f"{what}, more than the artifact's max_cache_len {self.max_cache_len}; shorten it or re-export "
                "with a larger --max-cache-len"
            )
        return PromptTooLongError(
            f"{what}; with --max-new-tokens {self.max_new_tokens} it exceeds the artifact's max_cache_len "
            f"{self.max_cache_len}; ask for at most {self.max_cache_len - n + 1} new tokens, shorten the turn "
            "or re-export with a larger --max-cache-len"
        )

    def say(self, text: str, on_text: Callable[[str], None] | None = None, stop: Callable[[], bool] | None = None,
            on_notice: Callable[[str], None] | None = None) -> Turn:
        """The reply to the user's ``text``. ``on_text(piece)`` gets the reply's text as it is generated;
        ``stop()`` returning True ends the reply there (what was generated is kept); ``on_notice(line)``
        gets, before the reply, what the user should know (the conversation starts over). The turn's
        ``notices`` also say when the reply was cut by a full cache."""
        check_utf8(text)  # the user's own text, where the position of a bad byte means something
        user = {"role": "user", "content": text}
        messages = [*self.messages, user]
        ids = self.tokenizer.encode_chat(messages)
        notices: list[str] = []
        cached = self._cache.ids
        # Fed from position 0 although the conversation had a turn: the cache starts over.
        reset = len(self.messages) > len(self._first_messages())
        dropped = False
        if not self._fits(len(ids)):
            fresh = [*self._first_messages(), user]
            fresh_ids = ids if fresh == messages else self.tokenizer.encode_chat(fresh)
            if not self._fits(len(fresh_ids)):
                raise self._too_long(len(fresh_ids))  # the conversation is left as it was
            self.reset()
            messages, ids, dropped = fresh, fresh_ids, True
            notices.append(
                f"the conversation no longer fits in the cache ({self.max_cache_len} positions); it starts over "
                f"from this turn{', keeping the system prompt' if self.system else ''}"
            )
            if on_notice is not None:
                on_notice(notices[-1])
        common = 0 if dropped else common_prefix_length(cached, ids)
        # Earlier turns rendered differently (Gemma's template trims a reply): a program whose layers
        # are all full ones goes back to where the ids part (``Manifest.rewind``); one with rings or
        # states, whose cache cannot go back that far, feeds the conversation again from position 0.
        goes_back = common == len(cached) or self.manifest.rewind >= self.max_cache_len
        if 0 < common < len(ids) and goes_back:
            start, reset = common, False
        else:  # a first turn, or a cache that cannot go back to where the ids part
            start = 0
            self._cache.clear()

        stream = self.tokenizer.decode_stream() if on_text is not None else None

        def on_token(token: int) -> None:
            piece = stream(token)
            if piece:
                on_text(piece)

        on_logits = (lambda step, logits: not stop()) if stop is not None else None
        try:
            if self.drafter is None:
                result = generate(self._cache, ids[start:], self.max_new_tokens, self.stop_ids, self.sampling,
                                  on_token=on_token if stream is not None else None, on_logits=on_logits, start=start)
            else:
                result = generate_with_draft(self._cache, ids[start:], self.max_new_tokens, self.drafter, self.draft_tokens,
                                             self.stop_ids, on_token=on_token if stream is not None else None,
                                             on_logits=on_logits, cached_ids=ids[:start])
        except BaseException:
            # What the cache holds is not known (an interrupted call): the next turn starts over.
            self._unfed = []
            self._cache.clear()
            raise
        reply = result.new_ids
        self._cache.keep_prefix_of(ids + reply)
        self._unfed = reply[len(self._cache.ids) - len(ids):]
        reply_text = self.tokenizer.decode(reply)
        self.messages = [*messages, {"role": "assistant", "content": reply_text}]
        if result.stopped_by == "max_cache_len":
            notices.append(f"the reply filled the cache ({self.max_cache_len} positions) and was cut; the next turn starts over")
        return Turn(
            text=reply_text,
            reply_ids=list(reply),
            prompt_ids=ids,
            prefilled_tokens=len(ids) - start,
            conversation_tokens=len(self._cache.ids),
            reset=reset,
            stopped_by=result.stopped_by,
            prefill_tokens_per_s=result.prefill_tokens_per_s,
            decode_tokens_per_s=result.decode_tokens_per_s,
            notices=notices,
            speculation=result.speculation.summary() if self.drafter is not None else None,
        )
