"""Chunked prefill on the torch engine: a prompt prefilled in chunks, each against the K/V the
earlier ones wrote, gives the logits, tokens and KV blocks of one whole prefill. The engines
that cannot chunk say so through the capability protocol."""

from __future__ import annotations

import pytest
import torch

from services.node.engines.base import ChunksPrefill, SamplingParams, chunks_prefill
from services.node.engines.torch_engine import TorchEngine
from shared.schemas import Embedding

GREEDY = SamplingParams(max_tokens=32)
PROMPT = list(range(5, 5 + 75))  # 75 tokens: chunks cross the 16-token KV blocks unevenly
SPLITS = [(75,), (16, 59), (10, 20, 45), (1, 31, 32, 11), (37, 37, 1)]


def run(engine: TorchEngine, rid: str, chunks: tuple[int, ...], n: int,
        params: SamplingParams = GREEDY) -> tuple[list[int], object]:
    """Prefill `PROMPT` in `chunks`, then decode to n tokens; the tokens and the result of the
    last chunk."""
    engine.add_request(rid, PROMPT, params)
    for size in chunks[:-1]:
        assert engine.prefill_chunk(rid, size).tokens == {}  # no token before the last chunk
    last = engine.prefill_chunk(rid, chunks[-1])
    out = [last.tokens[rid]]
    while len(out) < n:
        out.append(engine.decode([rid]).tokens[rid])
    return out, last


def test_torch_declares_chunking_and_others_do_not():
    assert issubclass(TorchEngine, ChunksPrefill)
    assert not chunks_prefill(None)


def test_other_engines_prefill_whole():
    openvino = pytest.importorskip("services.node.engines.openvino_engine")
    vllm = pytest.importorskip("services.node.engines.vllm_engine")
    assert not issubclass(openvino.OpenVINOEngine, ChunksPrefill)
    assert not issubclass(vllm.VllmEngine, ChunksPrefill)
    # The core learns it from the model's engine (ModelSpec.chunked_prefill): the same split.
    from shared.cluster import CHUNKED_PREFILL_ENGINES

    assert CHUNKED_PREFILL_ENGINES == {"torch", "auto"}  # "auto": torch on CPU and GPU


@pytest.mark.parametrize("chunks", SPLITS[1:])
def test_chunks_give_the_whole_prefills_logits_and_output(make_engine, chunks):
    engine = make_engine()
    lp = SamplingParams(max_tokens=32, logprobs=5)
    whole, whole_last = run(engine, "whole", (75,), 24, lp)
    chunked, chunked_last = run(engine, "chunked", chunks, 24, lp)
    assert chunked == whole
    a, b = whole_last.logprobs["whole"], chunked_last.logprobs["chunked"]
    assert a.top[0][0] == b.top[0][0]
    torch.testing.assert_close(torch.tensor([v for _, v in b.top]),
                               torch.tensor([v for _, v in a.top]), atol=1e-4, rtol=1e-4)


def test_chunks_hold_the_blocks_of_what_they_wrote(make_engine):
    engine = make_engine()
    block = engine.cache.block_size
    engine.add_request("r", PROMPT, GREEDY)
    done = 0
    for size in (10, 20, 30):
        engine.prefill_chunk("r", size)
        done += size
        assert len(engine.cache.block_tables["r"]) == -(-done // block)
        assert engine.cache.lengths["r"] == done
    engine.prefill_chunk("r", 15)
    engine.add_request("w", PROMPT, GREEDY)
    engine.prefill("w")
    assert engine.cache.block_tables["r"].__len__() == len(engine.cache.block_tables["w"])
    assert engine.cache.lengths["r"] == engine.cache.lengths["w"] == 75
    engine.release("r")
    engine.release("w")
    assert engine.memory().kv_used_bytes == 0


def test_prompt_logprobs_across_chunks(make_engine):
    engine = make_engine()
    params = SamplingParams(max_tokens=4, prompt_logprobs=2)
    _, whole = run(engine, "whole", (75,), 2, params)
    _, chunked = run(engine, "chunked", (30, 44, 1), 2, params)
    a, b = whole.prompt_logprobs["whole"], chunked.prompt_logprobs["chunked"]
    assert len(a) == len(b) == 74
    torch.testing.assert_close(torch.tensor([x.logprob for x in b]),
                               torch.tensor([x.logprob for x in a]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_an_embedding_pooled_across_chunks_is_the_whole_prefills(make_engine, pooling):
    engine = make_engine()
    params = SamplingParams(max_tokens=0, embedding=Embedding(pooling, normalize=False))
    engine.add_request("whole", PROMPT, params)
    whole = engine.prefill("whole").embeddings["whole"]
    engine.add_request("chunked", PROMPT, params)
    assert engine.prefill_chunk("chunked", 33).embeddings == {}
    chunked = engine.prefill_chunk("chunked", 42).embeddings["chunked"]
    a, b = (torch.frombuffer(bytearray(v), dtype=torch.float32) for v in (whole, chunked))
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_refuses_what_is_not_a_next_chunk(make_engine):
    engine = make_engine()
    engine.add_request("r", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="does not fit"):
        engine.prefill_chunk("r", 76)
    engine.prefill_chunk("r", 40)
    with pytest.raises(ValueError, match="does not fit"):
        engine.prefill_chunk("r", 36)
    # prefill() after a chunk runs the rest: the same as the whole prefill's token
    rest = engine.prefill("r").tokens["r"]
    engine.add_request("w", PROMPT, GREEDY)
    assert engine.prefill("w").tokens["w"] == rest
    with pytest.raises(ValueError, match="already prefilled"):
        engine.prefill_chunk("r", 1)
