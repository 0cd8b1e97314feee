"""Fixtures of the layer-stage tests: the tiny demo model (4 layers), a converted copy of it, and
stage processes started as the node starts them (`services.node.engines.stage_server.spawn_stage`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.node.engines.base import SamplingParams
from services.node.loader.convert import convert_checkpoint
from services.node.engines.stage_server import StageProcess, spawn_stage

GREEDY = SamplingParams(max_tokens=64, ignore_eos=True)
PROMPTS = {"a": list(range(5, 40)), "b": list(range(100, 117)), "c": [7, 9, 11, 13]}


@pytest.fixture(scope="session")
def tiny(demo_model, tmp_path_factory) -> Path:
    """The tiny model as Hugging Face files only (stages read its safetensors)."""
    return demo_model(tmp_path_factory.mktemp("stages-data"))


@pytest.fixture(scope="session")
def tiny_converted(tiny: Path, tmp_path_factory) -> Path:
    """A copy of the tiny model with the loader's converted checkpoint beside it."""
    target = tmp_path_factory.mktemp("stages-converted") / "tiny-llama"
    shutil.copytree(tiny, target)
    convert_checkpoint(target)
    return target


class Stages:
    """Stage processes started by a test module, stopped at its end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[StageProcess] = []

    def start(self, model: Path, start: int, end: int, **kwargs) -> StageProcess:
        log = self.log_dir / f"stage-{len(self.procs)}-{start}-{end}.log"
        proc = spawn_stage(model, start, end, timeout_s=300.0, log_path=log, **kwargs)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


@pytest.fixture(scope="module")
def stages(tmp_path_factory) -> Iterator[Stages]:
    group = Stages(tmp_path_factory.mktemp("stage-logs"))
    try:
        yield group
    finally:
        group.stop()


def generate(engine, steps: int = 24, hooks: dict | None = None, late: int = 8) -> dict:
    """Greedy tokens of PROMPTS on `engine`: a and b from the start, c joins at step `late`;
    hooks[step](engine) runs between iterations (a layer move while requests are in flight)."""
    hooks = hooks or {}
    out: dict[str, list[int]] = {}
    for rid in ("a", "b"):
        engine.add_request(rid, PROMPTS[rid], GREEDY)
        out[rid] = [engine.prefill(rid).tokens[rid]]
    for step in range(steps):
        if step in hooks:
            hooks[step](engine)
        if step == late:
            engine.add_request("c", PROMPTS["c"], GREEDY)
            out["c"] = [engine.prefill("c").tokens["c"]]
        for rid, token in engine.decode(list(out)).tokens.items():
            out[rid].append(token)
    for rid in out:
        engine.release(rid)
    return out


@pytest.fixture(scope="session")
def reference(tiny: Path) -> dict:
    """What one local instance generates (the outputs every split must reproduce)."""
    from services.node.engines.torch_engine import TorchEngine

    engine = TorchEngine(tiny)
    engine.load()
    try:
        return generate(engine)
    finally:
        engine.unload()
