"""Constrained decoding on the torch engine: each request with an output grammar has a matcher
(llguidance) that its sampled tokens advance; before each sampling step the matcher's token mask
sets every token it does not allow next to -inf.

A grammar is compiled once per (model, grammar) and kept (`_initial`, an LRU): a request starts
from a copy of that compiled matcher, which costs microseconds, where compiling a schema costs
milliseconds and building the tokenizer's byte trie for llguidance about a second (once per
model directory and process).

The end of the output: when the grammar is complete, llguidance allows the tokenizer's EOS. The
mask offers the request's own end tokens instead (its EOS ids and stop_token_ids), so the
scheduler ends the request as it ends any other. A matcher that failed (which a mask it computed
itself prevents) offers only those end tokens, so the request ends at once rather than producing
text the grammar does not allow.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from shared.grammar import compile_grammar
from shared.schemas import OutputGrammar

log = logging.getLogger("slinfer.node")

COMPILED_GRAMMARS = 64  # per process; a compiled matcher holds its lexer, some kB to MB


@lru_cache(maxsize=8)
def _tokenizer(model_dir: str, vocab_size: int):
    """llguidance's view of the model's tokenizer: every token's bytes, in a trie."""
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)


@lru_cache(maxsize=COMPILED_GRAMMARS)
def _initial(model_dir: str, vocab_size: int, grammar: OutputGrammar):
    """The compiled matcher of `grammar` in its initial state (copied, never advanced)."""
    import llguidance

    matcher = llguidance.LLMatcher(_tokenizer(model_dir, vocab_size), compile_grammar(grammar),
                                   log_level=0)
    if matcher.is_error():
        raise ValueError(f"the output grammar does not compile: {matcher.get_error()}")
    return matcher


class TokenGrammar:
    """One request's place in its grammar: `allowed()` before each step, `advance()` after."""

    def __init__(self, matcher, vocab_size: int, grammar_eos: list[int],
                 end_ids: tuple[int, ...]) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._grammar_eos = [t for t in grammar_eos if 0 <= t < vocab_size]
        self._end_ids = [t for t in end_ids if 0 <= t < vocab_size]
        self._consumed: list[int] = []  # output tokens the matcher has taken, in order

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next: bool [vocab], on the CPU."""
        if self._matcher.is_error():
            log.warning("an output grammar failed (%s); the request ends",
                        self._matcher.get_error())
            bits = np.zeros(self._vocab, dtype=bool)
        else:
            words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
            bits = np.unpackbits(words, bitorder="little")[:self._vocab].astype(bool)
        complete = self._matcher.is_error() or bool(bits[self._grammar_eos].any())
        bits[self._grammar_eos] = False
        if complete:  # the output may end here: with the request's end tokens
            bits[self._end_ids] = True
        return torch.from_numpy(bits)

    def advance(self, token: int) -> None:
        """The request produced `token` (an end token ends it: nothing to match)."""
        if token in self._end_ids:
            return
        self._matcher.consume_token(token)  # a failure leaves it in its error state
        self._consumed.append(token)

    def follow(self, output: list[int]) -> None:
        """Bring the matcher to the state after `output` (a resumed request's tokens, or a
        migrated one's replaced tail): back to their common prefix, then forward."""
        common = 0
        for mine, theirs in zip(self._consumed, output):
            if mine != theirs:
                break
            common += 1
        back = len(self._consumed) - common
        if back and not self._matcher.rollback(back):
            self._matcher.reset()
            common = 0
        del self._consumed[common:]
        for token in output[common:]:
            self.advance(token)


class Grammars:
    """The output grammars of one model's requests (its directory names the tokenizer)."""

    def __init__(self, model_dir: str | Path, vocab_size: int) -> None:
        self._model_dir = str(model_dir)
        self._vocab = vocab_size

    def start(self, grammar: OutputGrammar, end_ids: tuple[int, ...],
              output: list[int]) -> TokenGrammar:
        """A request's matcher, past the output it already has (`output`: resumed tokens).
        ValueError if the grammar does not compile."""
        matcher = _initial(self._model_dir, self._vocab, grammar).deep_copy()
        tokenizer = _tokenizer(self._model_dir, self._vocab)
        state = TokenGrammar(matcher, self._vocab, list(tokenizer.eos_tokens), end_ids)
        state.follow(output)
        return state


def mask_rows(logits: torch.Tensor, rows: list[tuple[int, TokenGrammar]]) -> None:
    """Set to -inf, in place, each listed row's tokens its grammar does not allow next."""
    for i, grammar in rows:
        allowed = grammar.allowed().to(logits.device)
        logits[i].masked_fill_(~allowed, float("-inf"))
