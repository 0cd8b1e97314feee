"""The offline model builder: tokenizer, chat template, loadable weights, real shapes."""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import pytest
import torch

from shared import modelgen


def test_tokenizer_round_trips_text(tokenizer):
    for text in ["Return a new list of the items.", "  indented\n\tcode = {'a': 1}",
                 "naïve café — ünïcödé ✓ 漢字", ""]:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(tokenizer("Return the value of the attribute.")["input_ids"]) < 12  # merges learnt
    assert tokenizer.eos_token == "</s>" and tokenizer.pad_token == "<pad>"


def test_chat_template_renders(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    bare = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not bare.endswith("<|assistant|>\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    user_id = tokenizer.convert_tokens_to_ids("<|user|>")
    assert user_id in ids and ids.count(tokenizer.bos_token_id) == 1  # markers are single tokens


@pytest.mark.integration  # loads the model with transformers
def test_tiny_directory_loads(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.max_position_embeddings) == (128, 4, 4, 2, 2048)
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id
    logits = model(torch.tensor([tokenizer("def f(x):")["input_ids"]])).logits
    assert torch.isfinite(logits).all()


def test_ensure_demo_model_is_cheap_once_built(data_dir, tiny_model_dir):
    start = time.perf_counter()
    assert modelgen.ensure_demo_model(data_dir) == tiny_model_dir
    assert time.perf_counter() - start < 0.5
    assert modelgen.is_built(tiny_model_dir, "tiny")


def test_cli_build_is_deterministic(tmp_path, tiny_model_dir):
    out = tmp_path / "again"
    assert modelgen.main(["--shape", "tiny", "--out", str(out), "--seed", "0"]) == 0
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert _digest(out / name) == _digest(tiny_model_dir / name), name
    with pytest.raises(SystemExit):
        modelgen.main(["--shape", "gpt-5", "--out", str(out)])


def test_sharded_weights_load_identically(tmp_path, tiny_model_dir, hf_model):
    """The multi-shard path (used by the 7B/13B shapes) writes an index HF can load."""
    from transformers import AutoModelForCausalLM

    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    modelgen.write_weights(hf_model.config, tmp_path, torch.float32, seed=0,
                           shard_bytes=1024 * 1024)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    for (name, a), (_, b) in zip(hf_model.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("shape,expected", [
    ("llama-2-7b", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                        max_position_embeddings=4096, params=6_738_415_616)),
    ("llama-2-13b", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                         num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                         max_position_embeddings=4096, params=13_015_864_320)),
    ("llama-3.2-3b", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                          num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=131072, params=3_212_749_824)),
    ("llama-3.2-1b", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=131072, tie_word_embeddings=True,
                          params=1_235_814_400)),
    ("qwen2.5-0.5b", dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                          num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                          vocab_size=151936, max_position_embeddings=32768,
                          tie_word_embeddings=True, params=494_032_768)),
])
def test_real_shape_configs(shape, expected):
    from transformers import AutoModelForCausalLM

    config = modelgen.model_config(shape)
    expected = dict(expected)
    params = expected.pop("params")
    assert {key: getattr(config, key) for key in expected} == expected
    assert config.dtype == torch.bfloat16  # the real shapes are stored as published: bf16
    specs = modelgen.weight_specs(config)
    assert sum(torch.Size(s).numel() for _, s, _ in specs) == params
    # The names and shapes we would write are exactly what HF expects (meta: no memory used).
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    hf_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        hf_shapes.pop("lm_head.weight")
    assert {name: shape for name, shape, _ in specs} == hf_shapes
    # Every tokenizer id is a valid embedding row.
    assert modelgen.SHAPE_SPECS[shape].tokenizer_vocab <= config.vocab_size


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.integration  # loads the model with transformers
def test_tiny_qwen2_directory_loads_with_biases(data_dir):
    from transformers import AutoModelForCausalLM

    path = modelgen.ensure_model(data_dir, "tiny-qwen2", "tiny-qwen2")
    model, info = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.model_type == "qwen2" and model.dtype == torch.float32
    bias = model.model.layers[0].self_attn.q_proj.bias
    assert bias is not None and bias.abs().sum() > 0  # random, not zero-initialised
