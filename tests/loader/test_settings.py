"""LoaderSettings.from_env: budgets, the node's checkpoint directory, bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.node.loader import LoaderSettings


def test_defaults_put_the_disk_tier_under_the_node_data_dir():
    settings = LoaderSettings.from_env({"SLINFER_DATA_DIR": "/data", "SLINFER_NODE_ID": "n3"})
    assert settings.disk_cache_dir == Path("/data/checkpoints/n3")
    assert 0 < settings.dram_cache_bytes <= 16 << 30
    assert not settings.convert_on_load


def test_explicit_budgets_and_disk_tier_off():
    settings = LoaderSettings.from_env({
        "SLINFER_NODE_DRAM_CACHE_BYTES": "1000", "SLINFER_NODE_DISK_CACHE_BYTES": "0",
        "SLINFER_LOADER_THREADS": "3", "SLINFER_CONVERT_ON_LOAD": "true"})
    assert settings.dram_cache_bytes == 1000 and settings.disk_cache_dir is None
    assert settings.threads == 3 and settings.convert_on_load


@pytest.mark.parametrize("env", [{"SLINFER_NODE_DRAM_CACHE_BYTES": "-1"},
                                 {"SLINFER_LOADER_THREADS": "0"},
                                 {"SLINFER_NODE_DRAM_CACHE_BYTES": "lots"}])
def test_bad_values_name_the_variable(env):
    with pytest.raises(ValueError, match=next(iter(env))):
        LoaderSettings.from_env(env)
