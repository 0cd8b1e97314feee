"""Logit processors and filters of the OpenAI and vLLM sampling parameters, as pure functions on
tensors (the torch engine applies them; tests check them on hand-made logits).

Processors change one row of logits [vocab] in place: `add_logit_bias`, then `penalize_output`
(presence and frequency penalties), in vLLM's order. `keep_min_p` filters a batch of
probabilities [batch, vocab] after temperature and before top-k/top-p. `prompt_logprobs`
scores a prompt (echo with logprobs) from its prefill's hidden states.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import TokenLogprobs

PROMPT_LOGPROBS_SLICE = 256  # prompt positions projected onto the vocabulary at once


def add_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> None:
    """OpenAI's logit_bias: each (token, bias) adds bias to that token's logit (±100 bans or
    forces a token; ids are checked against the vocabulary when the request is added)."""
    if not bias:
        return
    ids = torch.tensor([t for t, _ in bias], device=logits.device)
    values = torch.tensor([b for _, b in bias], device=logits.device, dtype=logits.dtype)
    logits.index_add_(0, ids, values)  # a token named twice gets both (JSON keys are unique)


def penalize_output(logits: torch.Tensor, output: list[int], presence: float,
                    frequency: float) -> None:
    """OpenAI's presence and frequency penalties over the tokens generated so far (not the
    prompt): logit -= presence · [count > 0] + frequency · count. Negative values encourage
    repetition."""
    if not output or (presence == 0 and frequency == 0):
        return
    counts = torch.bincount(torch.tensor(output, device=logits.device),
                            minlength=logits.shape[-1])[:logits.shape[-1]].to(logits.dtype)
    logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)


def keep_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min_p: zero the tokens of each row less likely than min_p times that row's most
    likely one, and renormalise (the most likely token always stays; min_p 0 keeps all)."""
    floor = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    kept = probs * (probs >= floor)
    return kept / kept.sum(dim=-1, keepdim=True)


def prompt_logprobs(lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: list[int], k: int) -> list[TokenLogprobs]:
    """Each prompt token after the first (`targets`): its log-probability given the tokens
    before it, and the k likeliest (log_softmax of the raw logits, as for output tokens).
    `hidden`: the prefill's final hidden states [seq, hidden], position i predicting
    targets[i]. The vocabulary projection runs a slice of positions at a time, so its logits
    stay small (a long prompt's whole [seq, vocab] would not)."""
    out: list[TokenLogprobs] = []
    for start in range(0, len(targets), PROMPT_LOGPROBS_SLICE):
        chosen = targets[start:start + PROMPT_LOGPROBS_SLICE]
        logprobs = torch.log_softmax(lm_head(hidden[start:start + len(chosen)]).float(), dim=-1)
        picked = logprobs.gather(1, torch.tensor(chosen, device=logprobs.device)[:, None])
        top_v, top_i = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
        for p, ids, values in zip(picked[:, 0].tolist(), top_i.long().tolist(), top_v.tolist()):
            out.append(TokenLogprobs(p, tuple(zip(ids, values))))
    return out
