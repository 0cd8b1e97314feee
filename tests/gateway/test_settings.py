"""GatewaySettings.from_env: defaults, parsing, and errors that name the variable."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from services.gateway.settings import GatewaySettings, parse_api_keys


def test_defaults():
    s = GatewaySettings.from_env({})
    assert (s.host, s.port, s.auth_enabled, s.max_body_bytes) == ("127.0.0.1", 8000, False, 1 << 20)
    assert s.default_max_tokens is None  # a request without max_tokens: the rest of the context


def test_parses_everything():
    s = GatewaySettings.from_env({
        "SLINFER_NATS_URL": "nats://n:4222", "SLINFER_REDIS_URL": "redis://r:6379/1",
        "SLINFER_GATEWAY_HOST": "0.0.0.0", "SLINFER_GATEWAY_PORT": "9000",
        "SLINFER_API_KEYS": " k1:alice , k2:bob,", "SLINFER_MAX_BODY_BYTES": "2048",
        "SLINFER_REQUEST_TIMEOUT_S": "2.5", "SLINFER_DEFAULT_MAX_TOKENS": "64"})
    assert s.nats_url == "nats://n:4222" and s.redis_url == "redis://r:6379/1"
    assert (s.host, s.port, s.max_body_bytes, s.request_timeout_s, s.default_max_tokens) == \
        ("0.0.0.0", 9000, 2048, 2.5, 64)
    assert dict(s.api_keys) == {"k1": "alice", "k2": "bob"}
    assert "k1" not in repr(s)  # keys stay out of logs
    with pytest.raises(TypeError):
        s.api_keys["k3"] = "eve"  # frozen all the way down
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.port = 1


@pytest.mark.parametrize(("env", "names"), [
    ({"SLINFER_GATEWAY_PORT": "http"}, "SLINFER_GATEWAY_PORT"),
    ({"SLINFER_GATEWAY_PORT": "70000"}, "SLINFER_GATEWAY_PORT"),
    ({"SLINFER_MAX_BODY_BYTES": "1"}, "SLINFER_MAX_BODY_BYTES"),
    ({"SLINFER_REQUEST_TIMEOUT_S": "0"}, "SLINFER_REQUEST_TIMEOUT_S"),
    ({"SLINFER_REQUEST_TIMEOUT_S": "soon"}, "SLINFER_REQUEST_TIMEOUT_S"),
    ({"SLINFER_DEFAULT_MAX_TOKENS": "0"}, "SLINFER_DEFAULT_MAX_TOKENS"),
    ({"SLINFER_API_KEYS": "justakey"}, "SLINFER_API_KEYS"),
    ({"SLINFER_API_KEYS": "k:a,k:b"}, "SLINFER_API_KEYS"),
    ({"SLINFER_NATS_URL": "http://x"}, "SLINFER_NATS_URL"),
    ({"SLINFER_REDIS_URL": "x"}, "SLINFER_REDIS_URL"),
    ({"SLINFER_GATEWAY_HOST": "0.0.0.0"}, "SLINFER_API_KEYS"),
    ({"SLINFER_API_KEYS": "k:operator"}, "SLINFER_API_KEYS"),  # reserved
    ({"SLINFER_API_KEYS": "k:a", "SLINFER_OPERATOR_KEYS": "k"}, "SLINFER_OPERATOR_KEYS"),
    ({"SLINFER_MODEL_ROOTS": "relative/dir"}, "SLINFER_MODEL_ROOTS"),
    ({"SLINFER_TENANT_MODELS_DIR": "rel"}, "SLINFER_TENANT_MODELS_DIR"),
    ({"SLINFER_TENANT_MODELS_DIR": "/m", "SLINFER_API_KEYS": "k:a/b"}, "SLINFER_TENANT_MODELS_DIR"),
    ({"SLINFER_TENANT_MAX_CONCURRENCY": "-1"}, "SLINFER_TENANT_MAX_CONCURRENCY"),
    ({"SLINFER_TENANT_RATE_LIMIT": "fast"}, "SLINFER_TENANT_RATE_LIMIT"),
    ({"SLINFER_TENANT_RATE_BURST": "0"}, "SLINFER_TENANT_RATE_BURST"),
    ({"SLINFER_MODEL_MAX_QUEUE": "-3"}, "SLINFER_MODEL_MAX_QUEUE"),
    ({"SLINFER_GATEWAY_METRICS_PORT": "99999"}, "SLINFER_GATEWAY_METRICS_PORT"),
])
def test_bad_values_name_the_variable(env, names):
    with pytest.raises(ValueError, match=names):
        GatewaySettings.from_env(env)


def test_parse_api_keys_tenant_may_contain_colon():
    assert parse_api_keys("abc:org:team") == {"abc": "org:team"}


def test_access_and_limits(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    s = GatewaySettings.from_env({
        "SLINFER_OPERATOR_KEYS": " op1, op2 ", "SLINFER_MODEL_ROOTS": f"{tmp_path / 'link'}:/srv/m",
        "SLINFER_TENANT_MODELS_DIR": str(tmp_path), "SLINFER_API_KEYS": "k:alice",
        "SLINFER_TENANT_MAX_CONCURRENCY": "8", "SLINFER_TENANT_RATE_LIMIT": "2.5",
        "SLINFER_TENANT_RATE_BURST": "5", "SLINFER_MODEL_MAX_QUEUE": "0",
        "SLINFER_METRICS_KEY": "scrape", "SLINFER_GATEWAY_METRICS_PORT": "9100"})
    assert s.operator_keys == {"op1", "op2"} and "op1" not in repr(s) and "scrape" not in repr(s)
    assert s.model_roots == (tmp_path / "real", Path("/srv/m"))  # symlinks followed once, here
    assert s.tenant_model_root("alice") == tmp_path / "alice"
    assert s.tenant_model_root("..") is None
    assert (s.tenant_max_concurrency, s.tenant_rate_limit, s.tenant_rate_burst, s.model_max_queue) == \
        (8, 2.5, 5, 0)
    assert (s.metrics_key, s.metrics_port, s.metrics_host) == ("scrape", 9100, "127.0.0.1")
    assert s.auth_enabled


def test_limits_defaults_bound_the_queue():
    s = GatewaySettings.from_env({})
    assert s.tenant_max_concurrency == 64 and s.model_max_queue == 256 and s.tenant_rate_limit == 0
    assert s.metrics_port is None and s.tenant_models_dir is None and s.model_roots == ()
    # Operator keys alone turn auth on, so a public host is allowed with them.
    assert GatewaySettings.from_env({"SLINFER_OPERATOR_KEYS": "op",
                                     "SLINFER_GATEWAY_HOST": "0.0.0.0"}).auth_enabled
