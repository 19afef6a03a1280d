"""The fence's Redis settings: every topology's URL form parses to what the docs say, and a bad
value fails when the settings are read, naming the setting."""

from __future__ import annotations

from typing import Any

import pytest

from celery_fence.config import FenceConfig
from celery_fence.errors import ConfigurationError
from celery_fence.leases.redis_client import parse_redis_settings


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"redis_url": "http://127.0.0.1"}, "fence_redis_url"),
        ({"redis_url": "sentinel://127.0.0.1:26379"}, "master_name"),
        ({"redis_url": "redis://a:1;redis://b:2"}, "fence_redis_cluster=True"),
        ({"redis_url": "redis://a:1/3", "redis_cluster": True}, "database 0"),
        ({"redis_url": "redis://a?ssl_ca_certs=/ca.pem"}, "rediss://"),
        ({"redis_url": "redis://a?colour=blue"}, "unknown query parameter 'colour'"),
        ({"redis_ssl": {"ssl_cert_reqs": "maybe"}}, "ssl_cert_reqs"),
        ({"redis_ssl": {"certfile": "/x"}}, "fence_redis_ssl"),
        ({"redis_transport_options": {"visibility_timeout": 1}}, "visibility_timeout"),
        ({"redis_transport_options": {"master_name": "m"}}, "only used with a sentinel://"),
        ({"redis_url": "unix:///run/r.sock", "redis_ssl": {"ssl_cert_reqs": "none"}}, "unix://"),
    ],
)
def test_bad_redis_settings_fail_early_naming_the_setting(
    settings: dict[str, Any], names: str
) -> None:
    conf = {f"fence_{k}": v for k, v in settings.items()}
    with pytest.raises(ConfigurationError, match=names.replace("?", r"\?")):
        FenceConfig.from_mapping(conf)


def test_settings_forms_parse_to_the_documented_topology() -> None:
    single = parse_redis_settings("rediss://fence:s%40cret@h:6380/2?ssl_cert_reqs=CERT_REQUIRED")
    assert single.kind == "single" and single.tls
    assert single.options["username"] == "fence" and single.options["password"] == "s@cret"
    assert (single.options["db"], single.options["ssl_cert_reqs"]) == (2, "required")
    sentinel = parse_redis_settings(
        "sentinel://:pw@10.0.0.1:26379/1;sentinel://10.0.0.2",
        transport_options={"master_name": "mymaster", "sentinel_kwargs": {"password": "s"}},
    )
    assert sentinel.kind == "sentinel" and sentinel.master_name == "mymaster"
    assert sentinel.nodes == (("10.0.0.1", 26379), ("10.0.0.2", 26379))
    assert sentinel.options == {"password": "pw", "db": 1}
    assert sentinel.sentinel_kwargs == {"password": "s"}
    cluster = parse_redis_settings("redis://n1:7000;redis://n2:7001", cluster=True)
    assert cluster.kind == "cluster" and cluster.nodes == (("n1", 7000), ("n2", 7001))
    # fence_redis_ssl turns TLS on as Celery's broker_use_ssl does, and wins over the URL
    ssl_dict = parse_redis_settings(
        "rediss://h?ssl_cert_reqs=none", ssl={"ssl_cert_reqs": "required"}
    )
    assert ssl_dict.options["ssl_cert_reqs"] == "required"
    assert parse_redis_settings("redis://h", ssl={"ssl_ca_certs": "/ca.pem"}).tls
