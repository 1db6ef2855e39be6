"""Incremental detokenization and stop strings, as pure logic: the detokenizer process and the
offline `LLM.generate` both feed one `RequestText` per request (token ids in; text deltas, the stop
string's end of the request, the flush at its finish out), so both produce the same text.

The window (a read offset into the ids): `ids[:read_offset]` is released left context whose decode
is `prefix_text`; each add decodes all of `ids` and releases what follows `prefix_text`. Ids left of
the context are dropped, so the window always starts at 0. Decoding with a few context ids
keeps SentencePiece's leading spaces and joins byte-fallback pieces. Rules:
- never retract: released text is never changed, even when the tokenizer re-decodes it;
- a trailing U+FFFD may be half a character, so it is held, but for a bounded number of tokens;
- text is held back only while it can still become a stop string, and a stop string is never
  released: the request's text ends right before it;
- skipped special tokens never enter the window, and a token that adds no text after some left
  context is dropped from it, so a long run of such tokens costs O(1) each (re-decoding a growing
  window would be quadratic). Without context a token may add no text only because the decoder strips a
  leading space; it becomes the context instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeserve.messages import PROMPT_TAIL

FFFD = "\ufffd"
MAX_CONTEXT = PROMPT_TAIL  # prompt ids used as left context: as many as the engine sends
# A character is at most 4 UTF-8 bytes, so 3 byte tokens may wait for a 4th: hold the whole
# trailing U+FFFD run that long (tokenizers' ByteFallback turns a whole unfinished byte run into
# U+FFFDs). Then hold only the last U+FFFD, the one a lossy UTF-8 decoder may still complete,
# and from 2 * HOLD_TOKENS on release everything.
HOLD_TOKENS = 4

Decode = Callable[[Sequence[int], bool], str]  # (ids, skip_special_tokens) -> text


def make_decoder(tokenizer: Any) -> Decode:
    """decode(ids, skip_special_tokens) identical to tokenizer.decode, via the Rust tokenizer
    directly when transformers would add nothing (half the cost per call)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids, skip: tokenizer.decode(list(ids), skip_special_tokens=skip)
    return lambda ids, skip: backend.decode(list(ids), skip_special_tokens=skip)


def skipped_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that decode(skip_special_tokens=True) drops: the added tokens marked special."""
    return frozenset(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)


class StopMatcher:
    """Cuts text before the first stop string, holding back only a suffix that may become one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of held + text that is safe to release; sets `stopped` on a match."""
        if not self.stops or self.stopped:
            return "" if self.stopped else text
        buf = self.held + text
        # Released text never ends in a stop's prefix, so a match can only start inside buf. The
        # first match is the one that ends first (generation stops there); ties: the longest.
        best: tuple[int, int] | None = None
        for s in self.stops:
            at = buf.find(s)
            if at >= 0 and (best is None or (at + len(s), at) < best):
                best = (at + len(s), at)
        if best is not None:
            self.stopped, self.held = True, ""
            return buf[: best[1]]
        keep = len(buf)
        for s in self.stops:  # the earliest start of a suffix that is a proper prefix of a stop
            j = buf.find(s[0], max(0, len(buf) - len(s) + 1))
            while j != -1 and j < keep:
                if s.startswith(buf[j:]):
                    keep = j
                    break
                j = buf.find(s[0], j + 1)
        self.held = buf[keep:]
        return buf[:keep]

    def flush(self) -> str:
        """At the end of the request: what was held can no longer become a stop string."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out


@dataclass
class Delta:
    text: str
    stopped: bool = False  # a stop string matched: the request is over, stop feeding it


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, *, decode: Decode | None = None,
                 skip: frozenset[int] | None = None) -> None:
        """prompt_ids: the prompt (or its tail); only the last MAX_CONTEXT ids are used. decode and
        skip may be shared between requests of one tokenizer (see make_decoder, skipped_ids)."""
        self._decode = decode or make_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        if not skip_special_tokens:
            skip = frozenset()
        self._skip = skip if skip is not None else skipped_ids(tokenizer)
        # Skipped ids are dropped before the tail is cut, so they cannot crowd out the context.
        kept = [int(i) for i in prompt_ids if int(i) not in self._skip]
        tail = kept[-MAX_CONTEXT:]
        self.ids = tail[self._clean_start(tail):]
        self.read_offset = len(self.ids)
        self.prefix_text = self._text()
        self.sent = ""  # released text decoded from ids[read_offset:]
        self.held_tokens = 0  # ids fed since text was last released
        self.stop = StopMatcher(stop)
        self.stopped = False

    def _text(self) -> str:
        return self._decode(self.ids, self.skip_special_tokens)

    def _clean_start(self, tail: list[int]) -> int:
        """Skip leading ids that decode to U+FFFD (a character cut by the tail) so they cannot
        garble the output's first characters; keep the whole tail if nothing decodes cleanly."""
        for start in range(len(tail)):
            if FFFD not in self._decode(tail[start:], self.skip_special_tokens):
                return start
        return 0

    def add(self, ids: int | Sequence[int]) -> Delta:
        """Feed newly generated ids; returns the text released by them."""
        if self.stopped:
            return Delta("", True)
        text = []
        for i in [ids] if isinstance(ids, int) else map(int, ids):
            if i in self._skip:
                continue
            # One id at a time: the hold bound counts ids since text was last released.
            self.ids.append(i)
            self.held_tokens += 1
            text.append(self.stop.feed(self._advance(final=False)))
            if self.stop.stopped:
                self.stopped = True
                break
        return Delta("".join(text), self.stopped)

    def flush(self) -> str:
        """The request finished: release everything still held (U+FFFDs, stop-string prefixes)."""
        if self.stopped:
            return ""
        text = self.stop.feed(self._advance(final=True))
        self.stopped = self.stop.stopped
        return text + self.stop.flush()

    def _advance(self, final: bool) -> str:
        text = self._release(final)
        if text:
            self.held_tokens = 0
        return text

    def _release(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        new_text = self._text()
        released = self.prefix_text + self.sent
        if not new_text.startswith(released):
            # The tokenizer re-decoded released text (ByteFallback turns a byte run that is not
            # valid UTF-8 yet into U+FFFDs). Wait while it may resolve, then resync by position.
            if not final and new_text.endswith(FFFD) and self.held_tokens < HOLD_TOKENS:
                return ""
            return self._commit(new_text[len(released):])
        pending = new_text[len(released):]
        if not pending and not self.sent and self.read_offset:
            del self.ids[self.read_offset:]  # these ids added no text: keep the window short
            self.held_tokens = 0
            return ""
        if final or not pending.endswith(FFFD) or self.held_tokens >= 2 * HOLD_TOKENS:
            return self._commit(pending)
        cut = len(pending.rstrip(FFFD)) if self.held_tokens < HOLD_TOKENS else len(pending) - 1
        self.sent += pending[:cut]
        return pending[:cut]

    def _commit(self, text: str) -> str:
        """Release text and slide the window: the ids just read become the next left context."""
        del self.ids[: self.read_offset]
        self.read_offset = len(self.ids)
        self.prefix_text = self._text()
        self.sent = ""
        return text


@dataclass
class TextUpdate:
    """What one feed released for a request."""

    text: str
    finish: str = ""  # "" while running; else the request's finish reason ("stop" on a stop string)
    abort: bool = False  # a stop string ended a request the engine still runs: abort it there


class RequestText:
    """One request's text from its generated ids: the single stop / abort / flush path of the
    detokenizer process and the offline LLM. Feed each step's ids and the engine's finish reason;
    once `finished`, further output of the request (steps the engine ran before it saw the abort)
    is the caller's to drop."""

    def __init__(self, detok: IncrementalDetokenizer) -> None:
        self.detok = detok
        self.finish = ""
        self.completion_tokens = 0

    @property
    def finished(self) -> bool:
        return bool(self.finish)

    def feed(self, ids: Sequence[int], finish: str = "") -> TextUpdate:
        """ids: the request's new ids this step (none when it ended between steps); finish: the
        engine's finish reason for it ("" while running)."""
        assert not self.finish, "fed a finished request"
        text, abort = "", False
        if len(ids):
            self.completion_tokens += len(ids)
            delta = self.detok.add(ids)
            text = delta.text
            if delta.stopped:
                abort = not finish  # the engine ended it already otherwise
                finish = "stop"
        if finish:
            text += self.detok.flush()
            self.finish = finish
        return TextUpdate(text, finish, abort)
