"""The tokenizer a GGUF vocabulary describes, rebuilt as a `tokenizers.Tokenizer` (no torch needed):
byte-level BPE (gpt2), SentencePiece BPE (llama) or WordPiece (bert), with llama.cpp's special tokens.
Imported by `GGUFVocab.build` only, so that the engine core imports `tokenizers` only for its first
structured-output request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tokenizers
from gguf import Keys
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE, WordPiece

from ember.errors import ModelLoadError
from ember.model.gguf_tokenizer import GGUFMetadata

# Tokens llama.cpp marks as CONTROL or USER_DEFINED must be matched whole, never split by BPE.
_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp's WordPiece vocabulary marks a word's first piece with this and drops "##" from the others.
_WORD_START = "\u2581"
# llama.cpp's defaults for a "bert" vocabulary without the ids (bert-base-uncased's): [CLS], [SEP], [UNK]
_BERT_DEFAULT_IDS = {Keys.Tokenizer.BOS_ID: 101, Keys.Tokenizer.SEP_ID: 102, Keys.Tokenizer.UNK_ID: 100}

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Same as llama3 except digits are split one by one.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer(meta: GGUFMetadata, model: str, tokens: Sequence[str], bos_id: int | None) -> tokenizers.Tokenizer:
    """Rebuild the HF tokenizer llama.cpp derived its vocabulary from.

    `bos_id` is the token to prepend to every encoding, or None when the model wants none (a WordPiece
    vocabulary always wraps a text in [CLS] ... [SEP], as llama.cpp does).
    """
    if model == "bert":
        return _wordpiece(meta, tokens)
    if model == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens)
    else:
        raise ModelLoadError(meta.path, f"unsupported tokenizer model {model!r} (supported: gpt2, llama, bert)")
    _add_special_tokens(meta, tokenizer, tokens)
    if bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def _add_special_tokens(meta: GGUFMetadata, tokenizer: tokenizers.Tokenizer, tokens: Sequence[str]) -> None:
    token_types = meta.get("tokenizer.ggml.token_type", [])
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types)
            if kind in (_CONTROL, _USER_DEFINED)
        ]
    )


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    """Token -> id, keeping the first id when a file repeats a token string."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    return vocab


def _bpe(meta: GGUFMetadata, vocab: dict[str, int], merges: list, **options: Any) -> BPE:
    """A BPE model, reporting a merge that names a missing token as a broken file, not a crash."""
    try:
        return BPE(vocab, merges, **options)
    except Exception as exc:  # tokenizers raises a bare Exception
        raise ModelLoadError(meta.path, f"invalid tokenizer vocabulary ({exc})") from exc


def _byte_level_bpe(meta: GGUFMetadata, tokens: Sequence[str]) -> tokenizers.Tokenizer:
    merges = [tuple(merge.split(" ", 1)) for merge in meta.require("tokenizer.ggml.merges")]
    pre = meta.get("tokenizer.ggml.pre")
    # llama.cpp looks a whole pre-token up in the vocabulary before merging for llama3 only.
    llama3 = pre in ("llama-bpe", "llama3")
    tokenizer = tokenizers.Tokenizer(_bpe(meta, _vocab(tokens), merges, ignore_merges=llama3))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif llama3 or pre == "qwen2":
        split = _LLAMA3_SPLIT if llama3 else _QWEN2_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                byte_level,
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: GGUFMetadata, tokens: Sequence[str]) -> tokenizers.Tokenizer:
    """SentencePiece stores scores, not merges; HF recovers BPE merges from them.

    Every token that splits into two vocabulary pieces yields that merge, ranked by the merged
    token's score, so higher-scoring tokens are formed first, as SentencePiece would.
    """
    vocab = _vocab(tokens)
    scores = meta.require("tokenizer.ggml.scores")
    candidates = [
        (-scores[index], vocab[token[:cut]], vocab[token[cut:]])
        for token, index in vocab.items()
        for cut in range(1, len(token))
        if token[:cut] in vocab and token[cut:] in vocab
    ]
    candidates.sort()
    merges = [(tokens[left], tokens[right]) for _, left, right in candidates]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else ("<unk>" if "<unk>" in vocab else None)
    tokenizer = tokenizers.Tokenizer(_bpe(meta, vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    space = "\u2581"
    tokenizer.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(space)] if add_space_prefix else []) + [normalizers.Replace(" ", space)]
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    return tokenizer


def _wordpiece(meta: GGUFMetadata, phantom_tokens: Sequence[str]) -> tokenizers.Tokenizer:
    """HF's BertTokenizerFast of an uncased vocabulary (llama.cpp's WordPiece tokenizer always lowercases
    and strips accents), from the vocabulary llama.cpp's converter rewrote (`_wordpiece_tokens`)."""
    tokens = _wordpiece_tokens(phantom_tokens, meta.require("tokenizer.ggml.token_type"))
    cls_id, sep_id, unk_id = (meta.get(key, default) for key, default in _BERT_DEFAULT_IDS.items())
    if max(cls_id, sep_id, unk_id) >= len(tokens):
        raise ModelLoadError(meta.path, f"[CLS], [SEP] or [UNK] id outside the {len(tokens)}-token vocabulary")
    cls, sep = tokens[cls_id], tokens[sep_id]
    tokenizer = tokenizers.Tokenizer(WordPiece(_vocab(tokens), unk_token=tokens[unk_id]))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    _add_special_tokens(meta, tokenizer, tokens)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, cls_id), (sep, sep_id)],
    )
    return tokenizer


def _wordpiece_tokens(tokens: Sequence[str], token_types: Sequence[int]) -> list[str]:
    """Undo llama.cpp's "phantom space" vocabulary: its converter keeps control tokens ([CLS], [SEP], ...)
    as they are, writes a word's first piece "the" as "\u2581the" and a continuation "##ing" as "ing"."""
    return [
        token if kind == _CONTROL else token[1:] if token.startswith(_WORD_START) else "##" + token
        for token, kind in zip(tokens, token_types)
    ]
