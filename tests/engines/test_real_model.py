"""The default real model (SmolLM2-135M-Instruct from its GGUF) through the torch engine: real
text, with the model's own chat template, rendered the way the gateway renders it."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.gateway.tokenization import encode_chat, render_chat
from services.node.engines.base import SamplingParams
from services.node.engines.torch_engine import TorchEngine

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def real_tokenizer(real_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir, local_files_only=True)


def gguf_chat_template() -> str:
    """The template stored in the GGUF file itself (what the model was published with)."""
    from gguf import GGUFReader

    from shared.default_model import fetch_gguf

    field = GGUFReader(fetch_gguf()).get_field("tokenizer.chat_template")
    assert field is not None
    return field.contents()


def test_the_directory_carries_the_models_chat_template(real_model_dir, real_tokenizer):
    assert real_tokenizer.chat_template == gguf_chat_template()
    text = render_chat(real_tokenizer, [{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert real_tokenizer.eos_token == "<|im_end|>"


def test_greedy_answer_names_paris(real_model_dir, real_tokenizer):
    engine = TorchEngine(real_model_dir, device="cpu")
    engine.load()
    try:
        assert 130e6 < engine.memory().weight_bytes / 4 < 140e6  # float32, 135M parameters
        ids = encode_chat(real_tokenizer, [{"role": "user",
                                            "content": "What is the capital of France?"}])
        eos = engine.eos_token_ids
        engine.add_request("r", ids, SamplingParams(max_tokens=32))
        out = [engine.prefill("r").tokens["r"]]
        while out[-1] not in eos and len(out) < 32:
            out.append(engine.decode(["r"]).tokens["r"])
    finally:
        engine.unload()
    assert out[-1] in eos, "the answer did not end by itself"
    answer = real_tokenizer.decode(out, skip_special_tokens=True)
    assert "Paris" in answer, answer
