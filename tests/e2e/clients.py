"""Clients of the end-to-end tests: the openai client on a stack, and Hugging Face's model on the
same directory as the reference the stack's answers are checked against."""

from __future__ import annotations

from functools import lru_cache

import openai


def openai_client(stack, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0,
                         timeout=timeout)


@lru_cache(maxsize=1)
def hf_model(model_dir: str):
    """(tokenizer, model) from Hugging Face for `model_dir`, loaded once per process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(model_dir),
            AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval())
