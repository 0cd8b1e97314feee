"""TorchEngine against Hugging Face generate, and its resize / evict / batching invariants."""

from __future__ import annotations

import pytest
import torch

from services.node.engines import create_engine
from services.node.engines.base import Engine, KVCacheFull, SamplingParams
from services.node.engines.torch_engine import TorchEngine

PROMPTS = [
    "Return the value of the attribute.",
    "def main():",
    "The quick brown fox jumps over the lazy dog, then writes a parser for configuration files",
]
GREEDY = SamplingParams(max_tokens=64)


def prompt_ids(tokenizer, index: int) -> list[int]:
    return tokenizer(PROMPTS[index])["input_ids"]


def run_alone(engine: TorchEngine, rid: str, ids: list[int], n: int,
              params: SamplingParams = GREEDY) -> list[int]:
    """Add, prefill, and decode until n new tokens (one request alone)."""
    engine.add_request(rid, ids, params)
    out = [engine.prefill(rid).tokens[rid]]
    while len(out) < n:
        out.append(engine.decode([rid]).tokens[rid])
    return out


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    # min_new_tokens keeps generate from stopping early (it masks EOS logits); the engine does
    # not stop by itself, so both produce exactly n tokens.
    inputs = torch.tensor([ids], device=hf_model.device)
    out = hf_model.generate(inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=2)
    return out[0, len(ids):].tolist()


def test_protocol_and_factory(tiny_model_dir):
    engine = create_engine("torch", tiny_model_dir)
    assert isinstance(engine, Engine) and engine.name == "torch"
    with pytest.raises(ValueError, match="torch"):
        create_engine("tensorrt", tiny_model_dir)
    with pytest.raises(RuntimeError, match="load"):
        engine.memory()


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_matches_hf_generate(make_engine, hf_model, tokenizer, index):
    ids = prompt_ids(tokenizer, index)
    expected = hf_greedy(hf_model, ids, 20)
    assert run_alone(make_engine(), "r", ids, 20) == expected


def test_batched_decode_matches_each_alone(make_engine, tokenizer):
    engine = make_engine()
    prompts = [prompt_ids(tokenizer, i) for i in range(3)]
    assert len({len(p) for p in prompts}) == 3  # different lengths: padding and masks matter
    alone = [run_alone(engine, f"alone{i}", p, 16) for i, p in enumerate(prompts)]

    # Continuous batching: requests join at different steps and decode together.
    out: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        rid = f"b{i}"
        engine.add_request(rid, ids, GREEDY)
        out[rid] = [engine.prefill(rid).tokens[rid]]
        for _ in range(2):
            for r, t in engine.decode(list(out)).tokens.items():
                out[r].append(t)
    while any(len(toks) < 16 for toks in out.values()):
        batch = [r for r, toks in out.items() if len(toks) < 16]
        for r, t in engine.decode(batch).tokens.items():
            out[r].append(t)
    assert [out[f"b{i}"] for i in range(3)] == alone


def test_resize_up_and_down_mid_generation(make_engine, tokenizer):
    prompts = [prompt_ids(tokenizer, i) for i in range(3)]
    reference = make_engine()
    expected = [run_alone(reference, f"r{i}", p, 24) for i, p in enumerate(prompts)]

    engine = make_engine(kv_capacity_bytes=64 * 16 * 2048)  # 64 blocks of 16 tokens
    block_bytes = engine.cache.block_bytes
    out = {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, GREEDY)
        out[f"r{i}"] = [engine.prefill(f"r{i}").tokens[f"r{i}"]]
    # A request that finishes early leaves a hole, so the resize really has to compact/remap.
    engine.add_request("hole", prompt_ids(tokenizer, 2), GREEDY)
    engine.prefill("hole")
    for step in range(23):
        if step == 5:
            engine.release("hole")
            engine.resize_kv(200 * block_bytes)
            assert engine.memory().kv_capacity_bytes == 200 * block_bytes
        if step == 12:
            used = engine.cache.used_blocks
            engine.resize_kv(used * block_bytes)  # down to exactly the blocks in use
            assert engine.memory().kv_capacity_bytes == engine.memory().kv_used_bytes
            engine.resize_kv((used + 8) * block_bytes)  # room to keep growing
        for r, t in engine.decode(list(out)).tokens.items():
            out[r].append(t)
    assert [out[f"r{i}"] for i in range(3)] == expected


def test_shrink_below_used_raises_and_keeps_state(make_engine, tokenizer):
    ids = prompt_ids(tokenizer, 2)
    expected = run_alone(make_engine(), "r", ids, 12)
    engine = make_engine()
    engine.add_request("r", ids, GREEDY)
    out = [engine.prefill("r").tokens["r"]]
    before = engine.memory()
    used_blocks = engine.cache.used_blocks
    with pytest.raises(ValueError):
        engine.resize_kv((used_blocks - 1) * engine.cache.block_bytes)
    assert engine.memory() == before
    while len(out) < 12:
        out.append(engine.decode(["r"]).tokens["r"])
    assert out == expected


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(64, temperature=0.9, top_p=0.9, seed=3)])
def test_evict_and_resume_on_second_engine(make_engine, tokenizer, params):
    ids = prompt_ids(tokenizer, 0)
    expected = run_alone(make_engine(), "r", ids, 20, params)

    first = make_engine()
    first.add_request("r", ids, params)
    out = [first.prefill("r").tokens["r"]]
    for _ in range(7):
        out.append(first.decode(["r"]).tokens["r"])
    tokens = first.evict("r")
    assert tokens == ids + out
    assert first.memory().kv_used_bytes == 0
    with pytest.raises(KeyError):
        first.decode(["r"])

    second = make_engine()
    second.add_request("r", tokens, params)  # recomputes the KV cache of all tokens
    out.append(second.prefill("r").tokens["r"])
    while len(out) < 20:
        out.append(second.decode(["r"]).tokens["r"])
    assert out == expected


def test_kv_cache_full_on_prefill_leaves_nothing_behind(make_engine, tokenizer):
    engine = make_engine(kv_capacity_bytes=2 * 16 * 2048)  # 2 blocks = 32 tokens
    ids = list(range(10, 50))  # 40 tokens need 3 blocks
    engine.add_request("r", ids, GREEDY)
    with pytest.raises(KVCacheFull):
        engine.prefill("r")
    assert engine.memory().kv_used_bytes == 0
    assert engine.num_tokens("r") == 40
    engine.resize_kv(3 * engine.cache.block_bytes)
    engine.prefill("r")  # now fits
    assert engine.memory().kv_used_bytes == 3 * engine.cache.block_bytes


def test_kv_cache_full_on_decode_is_all_or_nothing(make_engine, tokenizer):
    ids_a, ids_b = list(range(10, 42)), list(range(100, 131))  # 32 and 31 tokens
    expected = run_alone(make_engine(), "a", ids_a, 6)

    engine = make_engine(kv_capacity_bytes=5 * 16 * 2048)  # 5 blocks
    for rid, ids in (("a", ids_a), ("b", ids_b)):
        engine.add_request(rid, ids, GREEDY)
    out = [engine.prefill("a").tokens["a"]]
    engine.prefill("b")  # a: 2 blocks full, b: 2 blocks with 1 free slot; 1 block free
    engine.add_request("c", list(range(5, 20)), GREEDY)
    engine.prefill("c")  # takes the last free block
    state = (engine.memory(), engine.num_tokens("a"), engine.num_tokens("b"))
    with pytest.raises(KVCacheFull):
        engine.decode(["b", "a"])  # b fits in its last block, a needs a new one: neither moves
    assert (engine.memory(), engine.num_tokens("a"), engine.num_tokens("b")) == state
    engine.release("c")
    while len(out) < 6:
        out.append(engine.decode(["a"]).tokens["a"])
    assert out == expected


def test_memory_report_is_consistent(make_engine, hf_model, tokenizer):
    engine = make_engine(kv_capacity_bytes=5 * 16 * 2048 + 1000)  # rounds down to 5 blocks
    config = hf_model.config
    report = engine.memory()
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert report.kv_bytes_per_token == per_token
    assert report.kv_capacity_bytes == 5 * 16 * per_token
    assert report.weight_bytes == sum(p.numel() * 4 for p in hf_model.parameters())
    assert report.kv_used_bytes == 0

    engine.add_request("r", list(range(3, 20)), GREEDY)  # 17 tokens: 2 blocks
    engine.prefill("r")
    assert engine.memory().kv_used_bytes == 2 * 16 * per_token
    for _ in range(16):
        engine.decode(["r"])  # 33 tokens stored: 3 blocks
    assert engine.memory().kv_used_bytes == 3 * 16 * per_token
    engine.resize_kv(4 * 16 * per_token + 16 * per_token - 1)
    assert engine.memory().kv_capacity_bytes == 4 * 16 * per_token
    engine.release("r")
    assert engine.memory().kv_used_bytes == 0


def test_seeded_sampling_is_reproducible(make_engine, tokenizer):
    ids = prompt_ids(tokenizer, 1)
    engine = make_engine()

    def sample(rid: str, seed: int, **kw) -> list[int]:
        params = SamplingParams(64, temperature=kw.get("temperature", 1.0),
                                top_p=kw.get("top_p", 1.0), seed=seed)
        return run_alone(engine, rid, ids, 24, params)

    first, again, other = sample("a", 7), sample("b", 7), sample("c", 8)
    assert first == again
    assert first != other
    assert first != run_alone(engine, "g", ids, 24)  # sampling is not just greedy
    # A nucleus so small that only the top token survives is greedy, whatever the seed.
    assert sample("d", 1, top_p=1e-6) == run_alone(engine, "g2", ids, 24)

    # Batched with a greedy neighbour, the sampled request still draws the same tokens.
    engine.add_request("s", ids, SamplingParams(64, temperature=1.0, seed=7))
    engine.add_request("n", prompt_ids(tokenizer, 2), GREEDY)
    batched = [engine.prefill("s").tokens["s"]]
    engine.prefill("n")
    while len(batched) < 24:
        batched.append(engine.decode(["n", "s"]).tokens["s"])
    assert batched == first


def test_request_validation(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError):
        engine.add_request("r", [], GREEDY)
    with pytest.raises(ValueError):
        engine.add_request("r", [engine.config.vocab_size], GREEDY)
    engine.add_request("r", [5, 6, 7], GREEDY)
    with pytest.raises(ValueError):
        engine.add_request("r", [5], GREEDY)
    with pytest.raises(ValueError, match="prefilled"):
        engine.decode(["r"])
    engine.prefill("r")
    with pytest.raises(ValueError):
        engine.prefill("r")
    with pytest.raises(KeyError):
        engine.evict("nope")
