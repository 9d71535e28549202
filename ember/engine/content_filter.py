"""Blocked phrases (`--blocked-words FILE`): where generated text must stop, and how much of it may stream.

Phrases and text are compared after NFKC normalisation and case folding, so "ＨＥＬＬＯ", "Hello" and
"hello" are one phrase, and "cafe\\u0301" matches "café". Matching is by substring, without word
boundaries: a listed phrase is blocked wherever it appears, inside a longer word too.

Normalisation changes lengths ("ﬁ" becomes "fi", "e" + U+0301 becomes "é"), so the text is cut into
chunks, each a starter character and the combining marks after it, and every normalised character
remembers the chunk it came from. A match is cut before the whole chunk holding its first
character, so no part of a phrase is ever emitted. While streaming, the text from the earliest
chunk whose normalised form could still grow into a phrase is held back, and so is the last chunk,
which a combining mark in the next token could still change. (Compositions between two starters,
such as Hangul jamo, are outside this chunking; phrases in precomposed form match as usual.)

Only a window of the text near its end is normalised per token (each chunk yields at least one
normalised character, so a phrase of L normalised characters spans at most L chunks), and ASCII
windows skip `unicodedata` entirely: the cost per token does not grow with the text.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


def normalize(text: str) -> str:
    """NFKC, case folded, NFKC again (folding can undo normalisation, as in Unicode's NFKC_Casefold)."""
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())


@dataclass(frozen=True)
class Scan:
    blocked_at: int | None  # where the text must end: the start of the first blocked phrase's chunk
    safe_end: int  # how much of the text may be emitted while more may follow


@dataclass
class _Window:
    """The end of a text, normalised: `norm[i]` came from the chunk that starts at `owner[i]` in the text."""

    norm: str
    owner: list[int]
    last_chunk: int  # where the last chunk starts in the text
    last_norm: int  # where its normalised form starts in `norm`


class ContentFilter:
    def __init__(self, phrases: Iterable[str]) -> None:
        normalized = sorted({p for p in (normalize(line.strip()) for line in phrases) if p}, key=len, reverse=True)
        if not normalized:
            raise ValueError("blocked_words: no phrases given (blank lines are ignored)")
        self.phrases = normalized
        self.max_len = len(normalized[0])
        self._pattern = re.compile("|".join(map(re.escape, normalized)))
        self._prefixes = {p[:k] for p in normalized for k in range(1, len(p))}

    @classmethod
    def from_file(cls, path: str | Path) -> ContentFilter:
        """One phrase a line; surrounding whitespace and blank lines are ignored."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"blocked_words: cannot read {str(path)!r}: {e}") from None
        return cls(text.splitlines())

    def scan(self, text: str, since: int) -> Scan:
        """Look at `text`, of which the first `since` characters were scanned before (with no match)."""
        if not text:
            return Scan(None, 0)
        w = self._window(text, since)
        match = self._pattern.search(w.norm)
        if match is not None:
            return Scan(w.owner[match.start()], w.owner[match.start()])
        head = w.norm[:w.last_norm]
        for s in range(max(0, w.last_norm - self.max_len + 1), w.last_norm):
            if head[s:] in self._prefixes:
                return Scan(None, w.owner[s])
        return Scan(None, w.last_chunk)

    def _window(self, text: str, since: int) -> _Window:
        start = self._window_start(text, since)
        tail = text[start:]
        if tail.isascii():
            return _Window(tail.lower(), list(range(start, len(text))), len(text) - 1, len(tail) - 1)
        starts = [start + i for i, ch in enumerate(tail) if i == 0 or not unicodedata.combining(ch)]
        norm: list[str] = []
        owner: list[int] = []
        piece = ""
        for a, b in zip(starts, starts[1:] + [len(text)]):
            piece = normalize(text[a:b])
            norm.append(piece)
            owner += [a] * len(piece)
        joined = "".join(norm)
        return _Window(joined, owner, starts[-1], len(joined) - len(piece))

    def _window_start(self, text: str, since: int) -> int:
        """A chunk start at least `max_len` chunks before the chunk holding `since` (or 0)."""
        i, starters = min(since, len(text)), 0
        while i > 0 and starters <= self.max_len:
            i -= 1
            if not unicodedata.combining(text[i]):
                starters += 1
        return i
