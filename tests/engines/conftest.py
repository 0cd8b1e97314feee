"""Fixtures for the engine tests: one tiny random-weight Llama built per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch


# Engine tests run on CPU, and again on CUDA where a GPU is present.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slinfer-data")


@pytest.fixture(scope="session")
def tiny_model_dir(demo_model, data_dir: Path) -> Path:
    return demo_model(data_dir)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir: Path, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    return model.to(device).eval()


@pytest.fixture
def make_engine(tiny_model_dir: Path, device: str) -> Callable[..., object]:
    """A loaded TorchEngine over the tiny model; keyword arguments go to the constructor."""
    from services.node.engines.torch_engine import TorchEngine

    engines = []

    def make(**kwargs) -> TorchEngine:
        engine = TorchEngine(tiny_model_dir, **{"device": device, **kwargs})
        engine.load()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.unload()
