"""Incremental detokenization and chat prompts on the tiny model's byte-level BPE tokenizer."""

from __future__ import annotations

from services.gateway.tokenization import IncrementalDetokenizer, encode_chat, render_chat


def test_incremental_detokenizer_never_splits_a_character(hf_tokenizer):
    text = "naïve café — 日本語 ✓ emoji 🙂 end"
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(hf_tokenizer, hf_tokenizer.encode("prompt"))
    deltas = [detok.push([t]) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens were partial characters, held back


def test_special_tokens_are_not_emitted(hf_tokenizer):
    ids = hf_tokenizer.encode("done", add_special_tokens=False) + [hf_tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(hf_tokenizer)
    assert detok.push(ids) + detok.flush() == "done"


def test_chat_template_is_applied(hf_tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = render_chat(hf_tokenizer, messages)
    assert text.endswith("<|assistant|>\n") and "<|user|>\nU" in text
    ids = encode_chat(hf_tokenizer, messages)
    assert ids[0] == hf_tokenizer.bos_token_id and ids[1] != hf_tokenizer.bos_token_id  # one BOS
