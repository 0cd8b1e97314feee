"""The default real model (SmolLM2-135M-Instruct from its GGUF) through the torch engine: real
text, with the model's own chat template, rendered the way the gateway renders it."""

from __future__ import annotations

import os
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


def greedy_answer(engine, tokenizer, question: str) -> tuple[str, int]:
    """The engine's greedy answer to one chat message, which must end with EOS by itself, and
    the bytes of its weights."""
    engine.load()
    try:
        weight_bytes = engine.memory().weight_bytes
        ids = encode_chat(tokenizer, [{"role": "user", "content": question}])
        eos = engine.eos_token_ids
        engine.add_request("r", ids, SamplingParams(max_tokens=32))
        out = [engine.prefill("r").tokens["r"]]
        while out[-1] not in eos and len(out) < 32:
            out.append(engine.decode(["r"]).tokens["r"])
    finally:
        engine.unload()
    assert out[-1] in eos, "the answer did not end by itself"
    return tokenizer.decode(out, skip_special_tokens=True), weight_bytes


def test_greedy_answer_names_paris(real_model_dir, real_tokenizer):
    engine = TorchEngine(real_model_dir, device="cpu")
    answer, weight_bytes = greedy_answer(engine, real_tokenizer, "What is the capital of France?")
    assert "Paris" in answer, answer
    assert 130e6 < weight_bytes / 4 < 140e6  # float32, 135M parameters (the head is tied)


def test_through_the_nodes_checkpoint_loader(real_model_dir, real_tokenizer, tmp_path):
    """What a node of `slinfer up` runs: the directory converted to the loading format (the
    profiler service does this at registration) and loaded through the node's loader."""
    from services.node.loader import CheckpointLoader, LoaderSettings, convert_checkpoint

    model = tmp_path / real_model_dir.name
    model.mkdir()
    for f in real_model_dir.iterdir():  # hard links: the cached model stays unconverted
        os.link(f, model / f.name)
    convert_checkpoint(model)
    loader = CheckpointLoader(LoaderSettings(dram_cache_bytes=1 << 30, dram_bytes_per_s=1e10))
    engine = TorchEngine(model, device="cpu", loader=loader)
    answer, _ = greedy_answer(engine, real_tokenizer, "What is the capital of France?")
    assert engine.load_info["source"] == "loader"
    assert "Paris" in answer, answer


def test_two_instances_loading_at_once_both_come_out_whole(real_model_dir, tmp_path):
    """A node loads two instances side by side (the reservation station lets ops of different
    instances overlap), one from the model's files and one through its loader. transformers
    switches process-wide state while it builds a model, so without the engines taking turns to
    build, about a third of such loads came out with meta buffers (`make test` run 29: "Cannot
    copy out of meta tensor")."""
    import threading

    from services.node.loader import CheckpointLoader, LoaderSettings, convert_checkpoint

    converted = tmp_path / real_model_dir.name
    converted.mkdir()
    for f in real_model_dir.iterdir():
        os.link(f, converted / f.name)
    convert_checkpoint(converted)
    loader = CheckpointLoader(LoaderSettings(dram_cache_bytes=1 << 30, dram_bytes_per_s=1e10))
    failures: list[str] = []

    def load_and_unload(make) -> None:
        for _ in range(8):
            engine = make()
            try:
                engine.load()
                assert not any(t.is_meta for t in engine.model.state_dict().values())
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                failures.append(repr(exc)[:120])
            finally:
                engine.unload()

    threads = [threading.Thread(target=load_and_unload, args=(make,)) for make in (
        lambda: TorchEngine(real_model_dir, device="cpu"),
        lambda: TorchEngine(converted, device="cpu", loader=loader))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loader.close()
    assert not failures, failures
