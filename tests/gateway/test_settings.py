"""GatewaySettings.from_env: defaults, parsing, and errors that name the variable."""

from __future__ import annotations

import dataclasses

import pytest

from services.gateway.settings import GatewaySettings, parse_api_keys


def test_defaults():
    s = GatewaySettings.from_env({})
    assert (s.host, s.port, s.auth_enabled, s.max_body_bytes) == ("127.0.0.1", 8000, False, 1 << 20)


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
])
def test_bad_values_name_the_variable(env, names):
    with pytest.raises(ValueError, match=names):
        GatewaySettings.from_env(env)


def test_parse_api_keys_tenant_may_contain_colon():
    assert parse_api_keys("abc:org:team") == {"abc": "org:team"}
