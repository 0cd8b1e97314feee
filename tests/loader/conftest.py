"""Fixtures for the loader tests: small safetensors checkpoints built here (no model hub)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file



@pytest.fixture(scope="session")
def tiny_source(demo_model, tmp_path_factory) -> Path:
    """The tiny demo model (float32 safetensors, HF directory)."""
    return demo_model(tmp_path_factory.mktemp("loader-data"))


@pytest.fixture
def tiny_model(tiny_source: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model: conversions write into it."""
    target = tmp_path / "tiny-llama"
    shutil.copytree(tiny_source, target)
    return target


def odd_tensors() -> dict[str, torch.Tensor]:
    """Tensors whose sizes are not multiples of 4096 bytes, of several dtypes, one of them
    larger than a 16 KiB chunk and one empty."""
    g = torch.Generator().manual_seed(0)
    return {
        "a.bias": torch.randn(3, generator=g),  # 12 bytes
        "b.weight": torch.randn(1000, 3, generator=g).to(torch.bfloat16),  # 6000 bytes
        "c.ids": torch.randint(-100, 100, (4097,), generator=g, dtype=torch.int64),
        "d.mask": torch.rand(13, generator=g) > 0.5,
        "e.half": torch.randn(33, 129, generator=g).to(torch.float16),
        "f.big": torch.randn(5000, 3, generator=g),  # 60000 bytes: several 16 KiB chunks
        "g.empty": torch.zeros(0, 7),
        "h.int8": torch.randint(-5, 5, (4095,), generator=g, dtype=torch.int8),
    }


@pytest.fixture
def odd_model(tmp_path: Path) -> Path:
    """A two-file safetensors 'model' with odd-sized tensors and a config.json."""
    model = tmp_path / "odd"
    model.mkdir()
    tensors = odd_tensors()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:4]}, str(model / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[4:]}, str(model / "model-00002-of-00002.safetensors"))
    (model / "config.json").write_text('{"model_type": "odd"}\n')
    return model
