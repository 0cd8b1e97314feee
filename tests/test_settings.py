"""shared.settings: env parsing at the edge, with errors that name the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.settings import CommonSettings, env_bool, env_float, env_int, env_str


def test_defaults_when_unset_or_blank() -> None:
    env = {"SLINFER_X": "  "}
    assert env_str("SLINFER_X", "d", env=env) == "d"
    assert env_int("SLINFER_MISSING", 3, env=env) == 3
    assert env_float("SLINFER_MISSING", 0.5, env=env) == 0.5
    assert env_bool("SLINFER_MISSING", True, env=env) is True


def test_parses_values() -> None:
    env = {"A": " hello ", "B": "42", "C": "2.5", "D": "Yes", "E": "off"}
    assert env_str("A", env=env) == "hello"
    assert env_int("B", env=env) == 42
    assert env_float("C", env=env) == 2.5
    assert env_bool("D", env=env) is True
    assert env_bool("E", env=env) is False


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: env_int("SLINFER_PORT", env={"SLINFER_PORT": "80a"}), "SLINFER_PORT must be an integer"),
        (lambda: env_int("SLINFER_PORT", env={"SLINFER_PORT": "0"}, minimum=1), "SLINFER_PORT must be >= 1"),
        (lambda: env_float("SLINFER_F", env={"SLINFER_F": "x"}), "SLINFER_F must be a number"),
        (lambda: env_float("SLINFER_F", env={"SLINFER_F": "nan"}), "SLINFER_F must be a finite"),
        (lambda: env_float("SLINFER_F", env={"SLINFER_F": "9"}, maximum=1.0), "SLINFER_F must be <= 1.0"),
        (lambda: env_bool("SLINFER_B", env={"SLINFER_B": "maybe"}), "SLINFER_B must be one of"),
        (lambda: env_str("SLINFER_S", env={}, required=True), "SLINFER_S is required"),
    ],
)
def test_bad_values_name_the_variable(call, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        call()


def test_common_settings_from_env() -> None:
    assert CommonSettings.from_env({}) == CommonSettings()
    s = CommonSettings.from_env({
        "SLINFER_NATS_URL": "nats://nats:4222",
        "SLINFER_REDIS_URL": "redis://:pw@redis:6379/0",
        "SLINFER_DATA_DIR": "/data",
    })
    assert (s.nats_url, s.redis_url, s.data_dir) == ("nats://nats:4222", "redis://:pw@redis:6379/0", Path("/data"))


def test_common_settings_rejects_wrong_scheme() -> None:
    with pytest.raises(ValueError, match="SLINFER_REDIS_URL"):
        CommonSettings.from_env({"SLINFER_REDIS_URL": "http://redis:6379"})
    with pytest.raises(ValueError, match="SLINFER_NATS_URL"):
        CommonSettings.from_env({"SLINFER_NATS_URL": "127.0.0.1:4222"})


def test_chunked_prefill_is_off_unless_set() -> None:
    from shared.settings import core_config_from_env

    assert core_config_from_env({}).prefill_chunk_tokens == 0
    assert core_config_from_env({"SLINFER_PREFILL_CHUNK_TOKENS": "64"}).prefill_chunk_tokens == 64
    with pytest.raises(ValueError, match="SLINFER_PREFILL_CHUNK_TOKENS"):
        core_config_from_env({"SLINFER_PREFILL_CHUNK_TOKENS": "-1"})
