"""Tokenizers at the gateway: one per model directory (cached), prompt encoding with the chat
template, and incremental detokenization that never emits half a multi-byte character."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.gateway.errors import invalid_request
from services.gateway.tools import prompt_messages

log = logging.getLogger("slinfer.gateway")

# Used only when a model directory ships no chat template (e.g. a bare base model).
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TokenizerLoadError(Exception):
    pass


class TokenizerCache:
    """Loads each directory's tokenizer once, off the event loop; concurrent first requests for the
    same model share one load."""

    def __init__(self) -> None:
        self._loaded: dict[str, PreTrainedTokenizerBase] = {}
        self._loading: dict[str, asyncio.Future[PreTrainedTokenizerBase]] = {}

    async def get(self, path: str) -> PreTrainedTokenizerBase:
        if path in self._loaded:
            return self._loaded[path]
        if path not in self._loading:
            self._loading[path] = asyncio.ensure_future(asyncio.to_thread(_load, path))
        future = self._loading[path]
        try:
            tokenizer = await asyncio.shield(future)
        finally:
            if future.done():
                self._loading.pop(path, None)
        self._loaded[path] = tokenizer
        return tokenizer

    def forget(self, path: str) -> None:
        self._loaded.pop(path, None)


def _load(path: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, ... for a bad directory
        raise TokenizerLoadError(f"cannot load the tokenizer from {path!r}: {exc}") from exc


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt of a conversation, with the tools it may call (tools.py: rendered by the
    template where it knows tools, else written into the messages)."""
    template = getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
    messages, template_tools = prompt_messages(template, messages, tools)
    try:
        text = tokenizer.apply_chat_template(messages, tools=template_tools,
                                             chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except TemplateError as exc:  # a template's own check (roles must alternate, ...)
        raise invalid_request(f"The model's chat template cannot render these messages: {exc}",
                              param="messages", code="invalid_value") from None
    assert isinstance(text, str)
    return text


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    # The template writes BOS itself where the model wants one.
    return list(tokenizer.encode(render_chat(tokenizer, messages, tools),
                                 add_special_tokens=False))


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=True))


def vocab_size(tokenizer: PreTrainedTokenizerBase) -> int:
    return len(tokenizer)


def tokenizer_eos_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else []


class IncrementalDetokenizer:
    """Output token ids in, text deltas out.

    Decodes a sliding window (`prefix_offset`..end) and emits only what extends the previously
    decoded window text; a window ending in U+FFFD (an incomplete UTF-8 sequence split across byte
    tokens) waits for the next token. Seeding with the prompt's last tokens keeps tokenizers that
    drop a leading space at the start of a sequence (SentencePiece) from losing it.
    """

    SEED_TOKENS = 5

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int] | None = None) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list((prompt_ids or [])[-self.SEED_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of the output: whatever is still held back (a truncated character stays a
        replacement character)."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta



def prompt_offsets(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> tuple[str, list[int]]:
    """The text of prompt `ids` as the output is decoded (special tokens add none), and where
    each token's text starts in it (the completions API's text_offset, for echo)."""
    detok = IncrementalDetokenizer(tokenizer)
    offsets = []
    for token in ids:
        offsets.append(len(detok.text))
        detok.push([token])
    detok.flush()
    return detok.text, offsets
