"""The many-host settings: NATS server lists, Redis/Sentinel URLs, the stream replica count and a
node's bind/advertise addresses. Each bad value is refused at start with a ValueError that names
the variable to fix."""

from __future__ import annotations

import pytest

from services.gateway.settings import GatewaySettings
from services.node.settings import multicast_hosts
from shared.redis_client import SentinelTarget, parse_sentinel_url
from shared.settings import (CommonSettings, ListenHosts, check_redis_url, env_stream_replicas,
                             listen_hosts_from_env, nats_servers)


def test_a_nats_setting_is_one_url_or_a_list() -> None:
    assert nats_servers("nats://a:4222") == ["nats://a:4222"]
    assert nats_servers("nats://a:4222, tls://b:4222,nats://c") == [
        "nats://a:4222", "tls://b:4222", "nats://c"]


@pytest.mark.parametrize("value, fragment", [
    ("nats://a:4222,", "empty server"),
    ("nats://a:4222,,nats://b:4222", "empty server"),
    ("nats://a:4222,b:4222", "'b:4222'"),
    ("http://a:4222", "nats://"),
    ("nats://a:notaport", "bad port"),
])
def test_bad_nats_settings_name_the_variable(value: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=f"SLINFER_NATS_URL.*{fragment}"):
        CommonSettings.from_env({"SLINFER_NATS_URL": value})
    with pytest.raises(ValueError, match="SLINFER_NATS_URL"):
        GatewaySettings.from_env({"SLINFER_NATS_URL": value})


def test_a_sentinel_url_names_sentinels_master_db_and_password() -> None:
    assert parse_sentinel_url("redis+sentinel://:p%40ss@s1:26380,s2,[::1]:26381/main/3") == \
        SentinelTarget((("s1", 26380), ("s2", 26379), ("::1", 26381)), "main", 3, "p@ss")
    assert parse_sentinel_url("redis+sentinel://s1/main") == \
        SentinelTarget((("s1", 26379),), "main", 0, None)
    settings = GatewaySettings.from_env({"SLINFER_REDIS_URL": "redis+sentinel://s1,s2/main"})
    assert settings.redis_url == "redis+sentinel://s1,s2/main"


@pytest.mark.parametrize("value, fragment", [
    ("redis+sentinel://s1:26379", "names the master"),
    ("redis+sentinel://s1:26379/", "names the master"),
    ("redis+sentinel://s1:x/main", "bad Sentinel address"),
    ("redis+sentinel://s1,,s2/main", "empty Sentinel"),
    ("redis+sentinel://s1/main/zero", "must be a number"),
    ("http://:secret@redis:6379", "redis\\+sentinel://"),
    ("redis://:secret@redis:notaport/0", "bad port"),
])
def test_bad_redis_settings_name_the_variable(value: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=f"SLINFER_REDIS_URL.*{fragment}") as caught:
        check_redis_url(value)
    assert "secret" not in str(caught.value)  # a password never reaches a log
    with pytest.raises(ValueError, match="SLINFER_REDIS_URL"):
        CommonSettings.from_env({"SLINFER_REDIS_URL": value})


def test_stream_replicas() -> None:
    assert env_stream_replicas({}) == 1
    assert GatewaySettings.from_env({"SLINFER_STREAM_REPLICAS": "3"}).stream_replicas == 3
    for bad in ("0", "6", "three"):
        with pytest.raises(ValueError, match="SLINFER_STREAM_REPLICAS"):
            env_stream_replicas({"SLINFER_STREAM_REPLICAS": bad})


def test_node_hosts() -> None:
    assert listen_hosts_from_env({}) == ListenHosts("127.0.0.1", "127.0.0.1")
    assert listen_hosts_from_env({"SLINFER_NODE_BIND_HOST": "10.0.0.5"}) == \
        ListenHosts("10.0.0.5", "10.0.0.5")
    assert listen_hosts_from_env({"SLINFER_NODE_BIND_HOST": "0.0.0.0",
                                  "SLINFER_NODE_ADVERTISE_HOST": "node-1.svc"}) == \
        ListenHosts("0.0.0.0", "node-1.svc")
    # Nobody can dial "every address": the advertised one must be given.
    for wildcard in ("0.0.0.0", "::"):
        with pytest.raises(ValueError, match="SLINFER_NODE_ADVERTISE_HOST is required"):
            listen_hosts_from_env({"SLINFER_NODE_BIND_HOST": wildcard})
    with pytest.raises(ValueError, match="SLINFER_NODE_ADVERTISE_HOST"):
        listen_hosts_from_env({"SLINFER_NODE_ADVERTISE_HOST": "0.0.0.0"})


def test_multicast_hosts_follow_the_node_unless_overridden() -> None:
    node = ListenHosts("0.0.0.0", "10.0.0.5")
    assert multicast_hosts(node, None, None) == ("0.0.0.0", "10.0.0.5")
    assert multicast_hosts(node, "10.1.0.5", None) == ("10.1.0.5", "10.1.0.5")
    assert multicast_hosts(node, "0.0.0.0", None) == ("0.0.0.0", "10.0.0.5")
    assert multicast_hosts(node, "0.0.0.0", "node-cpu") == ("0.0.0.0", "node-cpu")
    assert multicast_hosts(ListenHosts(), None, None) == ("127.0.0.1", "127.0.0.1")
    with pytest.raises(ValueError, match="SLINFER_MULTICAST_ADVERTISE_HOST"):
        multicast_hosts(node, "0.0.0.0", "::")


def test_a_new_request_is_retried_within_its_ttft_and_timeout() -> None:
    from services.gateway.backend import submit_window
    from shared.bus import PUBLISH_RETRY_S
    from shared.schemas import InferenceRequest

    request = InferenceRequest("r", "t", "m", [1, 2, 3], 8, arrival=100.0, ttft_slo_s=8.0,
                               tpot_slo_s=0.25)
    assert submit_window(request, 300.0, now=101.0) == 7.0  # the TTFT left
    assert submit_window(request, 3.0, now=101.0) == 3.0  # the request's timeout
    assert submit_window(request, 300.0, now=120.0) == 0.0  # late already: one try
    batch = InferenceRequest("b", "t", "m", [1], 8, arrival=100.0, ttft_slo_s=600.0,
                             tpot_slo_s=2.0)
    assert submit_window(batch, 300.0, now=100.0) == PUBLISH_RETRY_S  # an election's worth
