"""Output tokens' log-probabilities in the OpenAI API's two shapes: chat's `logprobs.content`
(each token's text, logprob, UTF-8 bytes and its top alternatives) and the completions API's
parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

A token's text is what it adds to the output on its own; its bytes are the exact bytes it stands
for, which for a byte-level BPE or SentencePiece byte-fallback token can be part of a multi-byte
character (its text then shows U+FFFD, its bytes the truth: OpenAI's reason for `bytes`).
"""

from __future__ import annotations

import math
import re
import weakref
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from shared.schemas import TokenLogprob

# JSON has no -Infinity: a token the model rules out entirely gets this, as vLLM writes it.
LOGPROB_FLOOR = -9999.0
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte fallback
_METASPACE = "\u2581"  # SentencePiece's word boundary, a space in the text


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2's scheme) writes each byte as one printable character: printable
    Latin-1 bytes as themselves, the others as the characters from U+0100 on, in byte order.
    This is the map back from those characters to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(0x100 + i): b for i, b in enumerate(shifted)})
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


def _floor(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class TokenTexts:
    """Each token id's own text and bytes under one tokenizer (cached: a vocabulary's entries
    never change)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tok = tokenizer
        # A byte-level BPE tokenizer decodes its space character to a space; SentencePiece and
        # the others leave that character alone.
        self._byte_level = tokenizer.convert_tokens_to_string(["\u0120"]) == " "
        self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def of(self, token_id: int) -> tuple[str, list[int]]:
        """(text, UTF-8 bytes) of one token."""
        found = self._cache.get(token_id)
        if found is None:
            data = self._bytes(token_id)
            found = self._cache[token_id] = (data.decode("utf-8", errors="replace"), list(data))
        return found

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:  # special and added tokens stand for their own text
            return self._added[token_id].encode()
        piece = self._tok.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if match := _BYTE_TOKEN.match(piece):
            return bytes([int(match.group(1), 16)])
        if _METASPACE in piece:
            return piece.replace(_METASPACE, " ").encode()
        return self._tok.convert_tokens_to_string([piece]).encode()


_texts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_texts(tokenizer: PreTrainedTokenizerBase) -> TokenTexts:
    """The tokenizer's `TokenTexts`, made once per tokenizer."""
    texts = _texts.get(tokenizer)
    if texts is None:
        texts = _texts[tokenizer] = TokenTexts(tokenizer)
    return texts


@dataclass(frozen=True)
class TokenEntry:
    """One token with its logprobs and where its text starts in the text shown (an output
    token, or an echoed prompt token: the first has no logprobs, nothing precedes it)."""

    token_id: int
    logprobs: TokenLogprob | None
    offset: int  # characters of text before this token's (completions' text_offset)


@dataclass(frozen=True)
class LogprobsRenderer:
    """Renders a request's token entries in its API's shape; `top` alternatives per token."""

    texts: TokenTexts
    top: int

    def _top(self, lp: TokenLogprob) -> list[tuple[int, float]]:
        return list(zip(lp.top_ids, lp.top_logprobs))[:self.top]

    def chat(self, entries: list[TokenEntry]) -> dict[str, Any]:
        """choices[].logprobs of a chat completion or chunk."""
        return {"content": [self._chat_token(e) for e in entries], "refusal": None}

    def _chat_token(self, entry: TokenEntry) -> dict[str, Any]:
        assert entry.logprobs is not None  # chat echoes no prompt: every entry has them
        return {**self._chat_top(entry.token_id, entry.logprobs.logprob),
                "top_logprobs": [self._chat_top(t, lp) for t, lp in self._top(entry.logprobs)]}

    def _chat_top(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, data = self.texts.of(token_id)
        return {"token": text, "logprob": _floor(logprob), "bytes": data}

    def completion(self, entries: list[TokenEntry]) -> dict[str, Any]:
        """choices[].logprobs of a text completion or chunk: parallel lists. Each token's
        alternatives map text to logprob, and always hold the chosen token (OpenAI's "up to
        logprobs + 1" entries)."""
        tops: list[dict[str, float] | None] = []
        for e in entries:
            if e.logprobs is None:  # an echoed prompt's first token: null, as OpenAI writes it
                tops.append(None)
                continue
            alternatives: dict[str, float] = {}
            for token_id, logprob in self._top(e.logprobs):  # likeliest first: it keeps its text
                alternatives.setdefault(self.texts.of(token_id)[0], _floor(logprob))
            alternatives.setdefault(self.texts.of(e.token_id)[0], _floor(e.logprobs.logprob))
            tops.append(alternatives)
        return {"tokens": [self.texts.of(e.token_id)[0] for e in entries],
                "token_logprobs": [None if e.logprobs is None else _floor(e.logprobs.logprob)
                                   for e in entries],
                "top_logprobs": tops,
                "text_offset": [e.offset for e in entries]}
