"""What a model generates on one local torch engine, greedy: the output a test compares a served,
migrated, split or pipelined request's tokens against."""

from __future__ import annotations

from services.node.engines import SamplingParams
from services.node.engines.torch_engine import TorchEngine


def greedy_output(model_dir, prompt: list[int], max_tokens: int, **engine_args) -> list[int]:
    engine = TorchEngine(model_dir, **engine_args)
    engine.load()
    try:
        engine.add_request("ref", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))
        out = [engine.prefill("ref").tokens["ref"]]
        while len(out) < max_tokens:
            out.append(engine.decode(["ref"]).tokens["ref"])
        return out
    finally:
        engine.unload()
