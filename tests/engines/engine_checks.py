"""Protocol checks shared by the OpenVINO and vLLM engine tests: each takes loaded engines and the
greedy reference tokens (Hugging Face `generate` in float32) and asserts exact equality."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.node.engines.base import KVCacheFull, SamplingParams

GREEDY = SamplingParams(max_tokens=64)
N_TOKENS = 24

# Three prompts of different lengths (token ids of the tiny model's vocabulary of 2048).
PROMPTS = [list(range(5, 12)), list(range(100, 140)), [7, 9, 7]]


def engine_factory(build: Callable[..., object]) -> Iterator[Callable[..., object]]:
    """For a module fixture (`yield from`): a factory of loaded engines made by `build(**kwargs)`;
    every engine it made is unloaded after the module."""
    engines = []

    def factory(**kwargs):
        engine = build(**kwargs)
        engine.load()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.unload()


def per_token_f32(model_dir: Path) -> int:
    """KV bytes per token of a float32 cache: K and V, every layer and KV head."""
    c = json.loads((model_dir / "config.json").read_text())
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 4


def run_alone(engine, rid: str, ids: list[int], n: int,
              params: SamplingParams = GREEDY) -> list[int]:
    engine.add_request(rid, ids, params)
    out = [engine.prefill(rid).tokens[rid]]
    while len(out) < n:
        out.append(engine.decode([rid]).tokens[rid])
    engine.release(rid)
    return out


def run_to_end(engine, rid: str, ids: list[int], params: SamplingParams) -> list[int]:
    """Tokens until the engine says the request is done (max_tokens or an EOS it honours)."""
    engine.add_request(rid, ids, params)
    out = [engine.prefill(rid).tokens[rid]]
    while not engine.is_finished(rid):
        out.append(engine.decode([rid]).tokens[rid])
    engine.release(rid)
    return out


def hf_reference(model_dir, prompts=PROMPTS, n: int = N_TOKENS) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        gen = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=2)
        out.append(gen[0, len(ids):].tolist())
    return out


def check_greedy(engine, expected: list[list[int]]) -> None:
    for i, ids in enumerate(PROMPTS):
        assert run_alone(engine, f"alone{i}", ids, N_TOKENS) == expected[i], f"prompt {i}"
    assert engine.memory().kv_used_bytes == 0


def check_batching(engine, expected: list[list[int]]) -> None:
    """Requests join at different steps (each prefill alone), decode together, and one step
    decodes a strict subset; every request still gets exactly the tokens it gets alone."""
    out: dict[str, list[int]] = {}
    for i, ids in enumerate(PROMPTS):
        rid = f"b{i}"
        engine.add_request(rid, ids, GREEDY)
        result = engine.prefill(rid)
        assert set(result.tokens) == {rid}  # a prefill yields only its own token
        out[rid] = [result.tokens[rid]]
        for _ in range(2):
            step = engine.decode(list(out)).tokens
            assert set(step) == set(out)
            for r, t in step.items():
                out[r].append(t)
    step = engine.decode(["b0"]).tokens  # a strict subset
    assert set(step) == {"b0"}
    out["b0"].append(step["b0"])
    while any(len(t) < N_TOKENS for t in out.values()):
        batch = [r for r, t in out.items() if len(t) < N_TOKENS]
        for r, t in engine.decode(batch).tokens.items():
            out[r].append(t)
    assert [out[f"b{i}"] for i in range(3)] == expected
    for rid in out:
        engine.release(rid)


def check_resize(engine, block_bytes: int, expected: list[list[int]]) -> list[dict]:
    """Grow, then shrink to (almost) the blocks in use, mid-generation, with a finished request
    leaving a hole; output identical to the uninterrupted runs. Returns the rebuild timings."""
    out = {}
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"r{i}", ids, GREEDY)
        out[f"r{i}"] = [engine.prefill(f"r{i}").tokens[f"r{i}"]]
    engine.add_request("hole", PROMPTS[1], GREEDY)
    engine.prefill("hole")
    rebuilds = []
    for step in range(N_TOKENS - 1):
        if step == 5:
            engine.release("hole")
            engine.resize_kv(200 * block_bytes)
            assert engine.memory().kv_capacity_bytes == 200 * block_bytes
            rebuilds.append(dict(engine.last_rebuild))
        if step == 12:
            used = engine.memory().kv_used_bytes // block_bytes
            # A rebuild recomputes each running request's last token too: up to one more block
            # each than in use now.
            engine.resize_kv((used + len(out)) * block_bytes)
            assert engine.memory().kv_capacity_bytes == (used + len(out)) * block_bytes
            rebuilds.append(dict(engine.last_rebuild))
        for r, t in engine.decode(list(out)).tokens.items():
            out[r].append(t)
    assert [out[f"r{i}"] for i in range(3)] == expected
    for rid in out:
        engine.release(rid)
    assert engine.memory().kv_used_bytes == 0
    return rebuilds


def check_shrink_refused(engine, block_bytes: int, expected: list[int]) -> None:
    engine.add_request("s", PROMPTS[1], GREEDY)
    out = [engine.prefill("s").tokens["s"]]
    before = engine.memory()
    used = before.kv_used_bytes // block_bytes
    with pytest.raises(ValueError):
        engine.resize_kv((used - 1) * block_bytes)
    assert engine.memory() == before
    while len(out) < 12:
        out.append(engine.decode(["s"]).tokens["s"])
    assert out == expected[:12]
    engine.release("s")


def check_evict_and_resume(first, second, expected: list[int]) -> None:
    ids = PROMPTS[0]
    first.add_request("m", ids, GREEDY)
    out = [first.prefill("m").tokens["m"]]
    for _ in range(7):
        out.append(first.decode(["m"]).tokens["m"])
    tokens = first.evict("m")
    assert tokens == ids + out
    assert first.memory().kv_used_bytes == 0
    with pytest.raises(KeyError):
        first.decode(["m"])
    second.add_request("m", tokens, GREEDY)  # recomputes the KV cache of all tokens
    out.append(second.prefill("m").tokens["m"])
    while len(out) < N_TOKENS:
        out.append(second.decode(["m"]).tokens["m"])
    assert out == expected
    second.release("m")


def check_kv_full(engine, block_tokens: int) -> None:
    """The engine has 3 blocks. A prefill that needs 4 raises KVCacheFull and leaves nothing
    behind; a decode that needs one more block than is free raises and moves nobody."""
    assert engine.memory().kv_capacity_bytes // engine.memory().kv_bytes_per_token \
        == 3 * block_tokens
    big = list(range(10, 10 + 3 * block_tokens + 1))  # 4 blocks
    engine.add_request("big", big, GREEDY)
    with pytest.raises(KVCacheFull):
        engine.prefill("big")
    assert engine.memory().kv_used_bytes == 0 and engine.num_tokens("big") == len(big)
    engine.release("big")

    a = list(range(10, 10 + block_tokens))  # exactly one full block
    b = list(range(200, 200 + block_tokens - 1))  # one block with one free slot
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, GREEDY)
    engine.prefill("a")
    engine.prefill("b")
    engine.add_request("c", [5, 6, 7], GREEDY)
    engine.prefill("c")  # the last free block
    state = (engine.memory(), engine.num_tokens("a"), engine.num_tokens("b"))
    with pytest.raises(KVCacheFull):
        engine.decode(["b", "a", "c"])  # a's next token needs a new block: nobody moves
    assert (engine.memory(), engine.num_tokens("a"), engine.num_tokens("b")) == state
    engine.release("c")
    engine.decode(["a", "b"])  # c's block is free again (after at most one iteration)
    for rid in ("a", "b"):
        engine.release(rid)


def check_memory(engine, per_token: int, block_tokens: int) -> None:
    report = engine.memory()
    assert report.kv_bytes_per_token == per_token
    assert report.kv_used_bytes == 0 and report.weight_bytes > 0
    engine.add_request("mem", list(range(3, 3 + block_tokens + 1)), GREEDY)  # 2 blocks
    engine.prefill("mem")
    assert engine.memory().kv_used_bytes == 2 * block_tokens * per_token
    for _ in range(block_tokens):  # 2 * block_tokens + 1 tokens stored: 3 blocks
        engine.decode(["mem"])
    assert engine.memory().kv_used_bytes == 3 * block_tokens * per_token
    engine.release("mem")


def check_validation(engine) -> None:
    with pytest.raises(ValueError):
        engine.add_request("v", [], GREEDY)
    with pytest.raises(ValueError):
        engine.add_request("v", [10**6], GREEDY)
    engine.add_request("v", [5, 6, 7], GREEDY)
    with pytest.raises(ValueError):
        engine.add_request("v", [5], GREEDY)
    with pytest.raises(ValueError, match="prefilled"):
        engine.decode(["v"])
    engine.prefill("v")
    with pytest.raises(ValueError):
        engine.prefill("v")
    with pytest.raises(KeyError):
        engine.evict("nope")
    engine.release("v")
    engine.release("v")  # unknown: a no-op


def check_seeded_sampling(engine) -> None:
    params = SamplingParams(64, temperature=1.0, top_p=0.95, seed=7)
    first = run_alone(engine, "x1", PROMPTS[0], 16, params)
    again = run_alone(engine, "x2", PROMPTS[0], 16, params)
    other = run_alone(engine, "x3", PROMPTS[0], 16, SamplingParams(64, temperature=1.0, seed=8))
    greedy = run_alone(engine, "x4", PROMPTS[0], 16)
    assert first == again
    assert first != other and first != greedy
