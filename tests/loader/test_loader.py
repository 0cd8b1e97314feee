"""CheckpointLoader: which tier serves a load, DRAM LRU by bytes, the disk tier, the reports."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from services.node.loader import (CheckpointLoader, CheckpointMissing, LoaderSettings,
                                  convert_checkpoint)

FAST = 1e10  # a DRAM estimate, so tests skip the memcpy measurement


def _loader(tmp_path: Path, dram: int = 1 << 30, disk: int | None = None, **kw
            ) -> CheckpointLoader:
    settings = LoaderSettings(dram_cache_bytes=dram, dram_bytes_per_s=FAST,
                              disk_cache_dir=tmp_path / "node-disk" if disk else None,
                              disk_cache_bytes=disk or 0, threads=2, chunk_bytes=1 << 20, **kw)
    return CheckpointLoader(settings)


@pytest.fixture
def two_models(tiny_model: Path, tmp_path: Path) -> tuple[Path, Path]:
    other = tmp_path / "tiny-2"
    shutil.copytree(tiny_model, other)
    for model in (tiny_model, other):
        convert_checkpoint(model)
    return tiny_model, other


def _bytes(path: Path) -> int:
    return convert_checkpoint(path).index.file_bytes  # a no-op conversion: reads the index


def test_registry_then_dram(two_models, tmp_path):
    model, _ = two_models
    loader = _loader(tmp_path)
    first = loader.load(model)
    again = loader.load(model)
    assert (first.tier, again.tier) == ("registry", "dram")
    assert first.bytes == again.bytes == _bytes(model)
    assert first.direct and not again.direct
    # A DRAM hit views the pooled memory: no copy, the same storage as the first load's.
    name = "model.embed_tokens.weight"
    assert again.state_dict[name].data_ptr() == first.state_dict[name].data_ptr()
    private = loader.load(model, copy=True).state_dict[name]
    assert private.data_ptr() != first.state_dict[name].data_ptr()
    assert torch.equal(private, first.state_dict[name])
    loader.close()


def test_dram_evicts_the_least_recently_used_model_by_bytes(two_models, tmp_path):
    a, b = two_models
    loader = _loader(tmp_path, dram=_bytes(a) + _bytes(b) // 2)  # room for one of them
    assert loader.load(a).tier == "registry"
    assert loader.load(b).tier == "registry"  # evicts a
    assert loader.tier_of(a) == "registry" and loader.tier_of(b) == "dram"
    assert loader.load(b).tier == "dram"
    report = loader.tiers_report()
    dram = report.tiers[0]
    assert dram.name == "dram" and [m.model_path for m in dram.models] == [str(b)]
    assert dram.used_bytes == _bytes(b) <= dram.capacity_bytes
    loader.close()


def test_no_dram_budget_means_every_load_reads(two_models, tmp_path):
    model, _ = two_models
    loader = _loader(tmp_path, dram=0)
    assert [loader.load(model).tier for _ in range(2)] == ["registry", "registry"]
    loader.close()


def test_disk_tier_copy_is_used_and_survives_a_restart(two_models, tmp_path):
    model, _ = two_models
    loader = _loader(tmp_path, dram=0, disk=1 << 30)
    assert loader.load(model).tier == "registry"
    loader.wait_for_copies()
    assert loader.tier_of(model) == "disk"
    reference = loader.load(model)
    assert reference.tier == "disk"
    loader.close()
    # A new loader on the same node directory finds the copy (registry copy removed to prove it).
    shutil.rmtree(model / "slinfer-checkpoint")
    restarted = _loader(tmp_path, dram=0, disk=1 << 30)
    result = restarted.load(model)
    assert result.tier == "disk"
    for name, tensor in reference.state_dict.items():
        assert torch.equal(tensor, result.state_dict[name]), name
    restarted.close()


def test_disk_tier_evicts_by_bytes(two_models, tmp_path):
    a, b = two_models
    loader = _loader(tmp_path, dram=0, disk=_bytes(a) + _bytes(b) // 2)
    loader.load(a)
    loader.wait_for_copies()
    loader.load(b)
    loader.wait_for_copies()
    disk = loader.tiers_report().tiers[1]
    assert [m.model_path for m in disk.models] == [str(b)]
    assert len([p for p in (tmp_path / "node-disk").iterdir() if not p.name.startswith(".")]) == 1
    assert loader.tier_of(a) == "registry"
    loader.close()


def test_missing_checkpoint_raises_unless_converting_on_load(tiny_model, tmp_path):
    loader = _loader(tmp_path)
    assert not loader.has_checkpoint(tiny_model) and loader.tier_of(tiny_model) is None
    with pytest.raises(CheckpointMissing):
        loader.load(tiny_model)
    with pytest.raises(CheckpointMissing):
        loader.load(tmp_path / "nowhere")
    loader.close()
    converting = _loader(tmp_path, convert_on_load=True)
    assert converting.has_checkpoint(tiny_model)
    assert converting.load(tiny_model).tier == "registry"
    assert (tiny_model / "slinfer-checkpoint" / "index.json").is_file()
    converting.close()


def test_a_changed_source_is_not_served_from_a_stale_cache(two_models, tmp_path):
    model, _ = two_models
    loader = _loader(tmp_path)
    loader.load(model)
    assert loader.tier_of(model) == "dram"
    weights = next(model.glob("*.safetensors"))
    weights.touch()  # new mtime: a new source fingerprint
    assert loader.tier_of(model) is None  # the converted checkpoint is stale too
    with pytest.raises(CheckpointMissing):
        loader.load(model)
    loader.close()


def test_a_checkpoint_directory_can_be_loaded_directly(two_models, tmp_path):
    model, _ = two_models
    loader = _loader(tmp_path)
    result = loader.load(model / "slinfer-checkpoint")
    assert result.tier == "registry" and "model.norm.weight" in result.state_dict
    loader.close()


def test_bandwidth_is_measured_per_tier_and_feeds_the_estimate(two_models, tmp_path):
    model, other = two_models
    loader = _loader(tmp_path, registry_bytes_per_s=1e6)
    before = {t.name: t for t in loader.tiers_report().tiers}
    assert before["registry"].bytes_per_s == 1e6 and before["registry"].measured_loads == 0
    estimate = loader.estimate(model)
    assert estimate.tier == "registry" and estimate.bytes == _bytes(model)
    assert estimate.transfer_s == pytest.approx(_bytes(model) / 1e6)
    result = loader.load(model)
    after = {t.name: t for t in loader.tiers_report().tiers}
    assert after["registry"].measured_loads == 1
    assert after["registry"].bytes_per_s == pytest.approx(result.bytes / result.seconds)
    assert loader.estimate(model).tier == "dram"
    assert [m.model_path for m in after["registry"].models] == [str(model)]
    assert loader.estimate(other).queue_s == 0  # nothing pending
    loader.close()


def test_pending_counts_queued_loads_and_their_bytes(two_models, tmp_path):
    a, b = two_models
    loader = _loader(tmp_path, dram=0)
    gate, entered = threading.Event(), threading.Event()
    read = loader._reader.read

    def slow_read(jobs):  # hold the first load inside its read until released
        entered.set()
        gate.wait(10)
        return read(jobs)

    loader._reader.read = slow_read
    threads = [threading.Thread(target=loader.load, args=(m,)) for m in (a, b)]
    threads[0].start()
    assert entered.wait(10)
    threads[1].start()
    for _ in range(1000):
        if loader.pending == 2:
            break
        threading.Event().wait(0.01)
    report = loader.tiers_report()
    assert loader.pending == 2 and report.pending == 2
    assert report.pending_bytes >= _bytes(a)  # the running one's bytes are known
    assert loader.estimate(b).queue_s > 0
    gate.set()
    for thread in threads:
        thread.join(10)
    assert loader.pending == 0 and loader.tiers_report().pending_bytes == 0
    loader.close()


def test_buffers_are_reused_only_once_nothing_views_them(two_models, tmp_path):
    model, _ = two_models
    loader = _loader(tmp_path)
    held = loader.load(model)  # an engine holding the weights
    assert loader.drop(model) and not loader.drop(model)
    name = "model.norm.weight"
    reread = loader.load(model)
    assert reread.tier == "registry" and loader._buffers.reused == 0  # still viewed: not reused
    assert reread.state_dict[name].data_ptr() != held.state_dict[name].data_ptr()
    expected = held.state_dict[name].clone()
    loader.drop(model)
    del held  # the first load's memory is free now: the next read goes into it
    again = loader.load(model)
    assert loader._buffers.reused >= 1
    assert torch.equal(again.state_dict[name], expected)
    for tensor_name, tensor in reread.state_dict.items():  # the other copy is untouched
        assert torch.equal(tensor, again.state_dict[tensor_name]), tensor_name
    loader.close()


def test_free_buffers_are_trimmed_to_the_dram_budget(two_models, tmp_path):
    model, _ = two_models
    loader = _loader(tmp_path, dram=_bytes(model) * 3)
    result = loader.load(model)
    loader.drop(model)
    del result
    loader.load(model)  # reuses; the cached checkpoint and free buffers fit the budget
    assert loader._buffers.free_bytes() == 0
    loader.close()
