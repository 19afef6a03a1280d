"""The lease store's redis-py client, built from settings: one Redis, TLS, Sentinel or Cluster.

``fence_redis_url`` forms (parsed and validated once, with :func:`parse_redis_settings`):

- ``redis://[user:password@]host[:port][/db]`` — one Redis.
- ``rediss://...`` — one Redis over TLS; the certificate options come from the URL query
  (``?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem&ssl_certfile=...&ssl_keyfile=...``) or from
  ``fence_redis_ssl`` (a dict with the same keys, as Celery's ``broker_use_ssl``). Certificates are
  verified by default (``ssl_cert_reqs='required'``).
- ``unix://[user:password@]/path/to/redis.sock[?db=N]`` — one Redis on a Unix socket.
- ``sentinel://[user:password@]host:port[/db];sentinel://host2:port`` — Celery's own Sentinel
  broker URL form. ``fence_redis_transport_options={'master_name': 'mymaster'}`` names the
  monitored master (required); ``sentinel_kwargs`` (e.g. the sentinels' own password or TLS) and
  ``min_other_sentinels`` are passed to redis-py's ``Sentinel`` as Celery passes them. The URL's
  credentials, db and ``fence_redis_ssl`` apply to the master connections.
- With ``fence_redis_cluster=True``: ``redis[s]://[user:password@]host:port[;redis[s]://host2:port]``
  lists startup nodes of a Redis Cluster (db 0 only); the rest of the topology is discovered.

Key query parameters accepted in any form: ``socket_timeout``, ``socket_connect_timeout``,
``health_check_interval``, ``client_name``, ``db`` and the ``ssl_*`` options above. Anything
else is refused at configuration time with a message naming the setting.

``fence_redis_client`` (a callable returning a ready redis-py client) bypasses all of this.
"""

from __future__ import annotations

import ssl as _ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_fence.errors import ConfigurationError

#: Port used for ``sentinel://host`` without one.
DEFAULT_SENTINEL_PORT = 26379
#: Port used for ``redis://host`` without one.
DEFAULT_REDIS_PORT = 6379
#: Seconds between connection health checks (PING) on an idle connection (single/Sentinel).
DEFAULT_HEALTH_CHECK_INTERVAL = 30

#: ``fence_redis_ssl`` keys (also accepted as ``rediss://`` URL query parameters).
SSL_OPTIONS = frozenset(
    {
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_check_hostname",
    }
)
_QUERY_PARSERS: dict[str, Callable[[str], Any]] = {
    "db": int,
    "socket_timeout": float,
    "socket_connect_timeout": float,
    "health_check_interval": int,
    "client_name": str,
}
#: ``fence_redis_transport_options`` keys that tune connections (any topology).
CONNECTION_OPTIONS = frozenset(
    {
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "health_check_interval",
        "max_connections",
        "client_name",
    }
)
#: ``fence_redis_transport_options`` keys for Sentinel, named as in Celery's transport options.
SENTINEL_OPTIONS = frozenset({"master_name", "sentinel_kwargs", "min_other_sentinels"})

_CERT_REQS = {
    "none": "none",
    "cert_none": "none",
    "optional": "optional",
    "cert_optional": "optional",
    "required": "required",
    "cert_required": "required",
}

Kind = Literal["single", "sentinel", "cluster"]


@dataclass(frozen=True)
class RedisTarget:
    """Where the lease store lives, parsed from the settings (no connection is made)."""

    kind: Kind
    #: Sentinel addresses (``sentinel``) or startup nodes (``cluster``); empty for ``single``.
    nodes: tuple[tuple[str, int], ...] = ()
    #: Keyword arguments of the data connections (host/port/path for ``single`` only).
    options: dict[str, Any] = field(default_factory=dict)
    master_name: str | None = None
    sentinel_kwargs: dict[str, Any] | None = None
    min_other_sentinels: int = 0

    @property
    def tls(self) -> bool:
        return bool(self.options.get("ssl"))


def _cert_reqs(setting: str, value: Any) -> str:
    if isinstance(value, _ssl.VerifyMode) or (isinstance(value, int) and value in (0, 1, 2)):
        return {0: "none", 1: "optional", 2: "required"}[int(value)]
    if isinstance(value, str) and value.strip().lower() in _CERT_REQS:
        return _CERT_REQS[value.strip().lower()]
    raise ConfigurationError(
        f"{setting}: ssl_cert_reqs={value!r} is not one of 'required', 'optional', 'none' "
        "(or ssl.CERT_REQUIRED / CERT_OPTIONAL / CERT_NONE); use 'required' to verify the server."
    )


def _ssl_options(setting: str, raw: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in SSL_OPTIONS:
            raise ConfigurationError(
                f"{setting}: unknown TLS option {name!r}; use {', '.join(sorted(SSL_OPTIONS))}."
            )
        if name == "ssl_cert_reqs":
            out[name] = _cert_reqs(setting, value)
        elif name == "ssl_check_hostname":
            if isinstance(value, str):
                value = value.strip().lower() in {"1", "true", "yes", "on"}
            out[name] = bool(value)
        elif value is not None:
            if not isinstance(value, str):
                raise ConfigurationError(f"{setting}: {name}={value!r} must be a file path string.")
            out[name] = value
    return out


def _split_url(url: str) -> list[str]:
    return [part.strip() for part in url.split(";") if part.strip()]


def _url_options(part: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(the split URL, connection options, TLS options) of one URL of ``fence_redis_url``."""
    try:
        parts = urlsplit(part)
        _ = parts.port  # a malformed port raises here, not at the first connection
    except ValueError as exc:
        raise ConfigurationError(f"fence_redis_url={part!r} is not a valid URL: {exc}.") from None
    options: dict[str, Any] = {}
    ssl_raw: dict[str, Any] = {}
    for name, values in parse_qs(parts.query, keep_blank_values=True).items():
        value = values[-1]
        if name in SSL_OPTIONS:
            ssl_raw[name] = value
        elif name in _QUERY_PARSERS:
            try:
                options[name] = _QUERY_PARSERS[name](value)
            except ValueError:
                raise ConfigurationError(
                    f"fence_redis_url: query parameter {name}={value!r} is not valid."
                ) from None
        else:
            allowed = sorted({*_QUERY_PARSERS, *SSL_OPTIONS})
            raise ConfigurationError(
                f"fence_redis_url: unknown query parameter {name!r}; use one of "
                f"{', '.join(allowed)} (or fence_redis_transport_options)."
            )
    if parts.username:
        options["username"] = unquote(parts.username)
    if parts.password:
        options["password"] = unquote(parts.password)
    path = unquote(parts.path or "")
    if parts.scheme != "unix" and path.strip("/") and "db" not in options:
        try:
            options["db"] = int(path.strip("/"))
        except ValueError:
            raise ConfigurationError(
                f"fence_redis_url={part!r}: the path must be a database number, e.g. '/0'."
            ) from None
    return parts, options, _ssl_options("fence_redis_url", ssl_raw)


def _address(parts: Any, default_port: int) -> tuple[str, int]:
    return (parts.hostname or "127.0.0.1", parts.port or default_port)


def _transport_options(raw: Mapping[str, Any] | None, kind: Kind) -> dict[str, Any]:
    raw = dict(raw or {})
    allowed = CONNECTION_OPTIONS | (SENTINEL_OPTIONS if kind == "sentinel" else frozenset())
    for name in raw:
        if name not in allowed:
            if name in SENTINEL_OPTIONS:
                raise ConfigurationError(
                    f"fence_redis_transport_options[{name!r}] is only used with a sentinel:// "
                    "fence_redis_url: remove it, or point fence_redis_url at your sentinels."
                )
            raise ConfigurationError(
                f"fence_redis_transport_options: {name!r} is not used by celery-fence; "
                f"allowed keys: {', '.join(sorted(allowed))}."
            )
    return raw


def parse_redis_settings(
    url: str,
    *,
    cluster: bool = False,
    ssl: Mapping[str, Any] | None = None,
    transport_options: Mapping[str, Any] | None = None,
) -> RedisTarget:
    """Validate the Redis settings and say where the lease store lives.

    Raises :class:`ConfigurationError` naming the setting and the fix.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError(
            "fence_redis_url is empty: set it to e.g. 'redis://127.0.0.1:6379/0'."
        )
    urls = _split_url(url)
    schemes = {u.split("://", 1)[0].lower() if "://" in u else "" for u in urls}
    known = {"redis", "rediss", "unix", "sentinel"}
    if not schemes <= known:
        raise ConfigurationError(
            f"fence_redis_url={url!r} must start with redis://, rediss://, unix:// or sentinel:// "
            "(or set fence_redis_client to a callable returning a redis client)."
        )
    if ssl is not None and not isinstance(ssl, Mapping):
        raise ConfigurationError(
            f"fence_redis_ssl={ssl!r} must be a dict of TLS options, e.g. "
            "{'ssl_cert_reqs': 'required', 'ssl_ca_certs': '/etc/redis/ca.pem'}."
        )
    ssl_settings = _ssl_options("fence_redis_ssl", ssl or {})
    kind: Kind = "sentinel" if "sentinel" in schemes else "cluster" if cluster else "single"
    options_raw = _transport_options(transport_options, kind)
    if kind == "sentinel" and schemes != {"sentinel"}:
        raise ConfigurationError(
            f"fence_redis_url={url!r} mixes sentinel:// with other schemes: list only the "
            "sentinels, 'sentinel://host1:26379;sentinel://host2:26379'."
        )
    if kind == "sentinel" and cluster:
        raise ConfigurationError(
            "fence_redis_cluster=True cannot be combined with a sentinel:// fence_redis_url: "
            "a Redis Cluster is addressed by its nodes (redis://host:port;redis://host2:port)."
        )
    if kind == "cluster" and (len(schemes) != 1 or not schemes <= {"redis", "rediss"}):
        raise ConfigurationError(
            f"fence_redis_cluster=True needs fence_redis_url of redis:// or rediss:// startup "
            f"nodes (one scheme), e.g. 'redis://10.0.0.1:7000;redis://10.0.0.2:7000'; got {url!r}."
        )
    if kind == "single" and len(urls) > 1:
        raise ConfigurationError(
            f"fence_redis_url={url!r} lists several servers: set fence_redis_cluster=True for a "
            "Redis Cluster, or use sentinel:// URLs for Sentinel."
        )

    first, options, url_ssl = _url_options(urls[0])
    nodes: list[tuple[str, int]] = []
    for i, part in enumerate(urls):
        parts, extra, _ = (first, options, url_ssl) if i == 0 else _url_options(part)
        if kind == "sentinel":
            nodes.append(_address(parts, DEFAULT_SENTINEL_PORT))
        elif kind == "cluster":
            nodes.append(_address(parts, DEFAULT_REDIS_PORT))
            if extra.get("db", 0) != 0:
                raise ConfigurationError(
                    f"fence_redis_url={part!r}: a Redis Cluster has only database 0; "
                    "remove the '/db' part (keys are already separated by fence_key_prefix)."
                )
    if kind == "cluster":
        options.pop("db", None)

    if url_ssl and first.scheme != "rediss":
        raise ConfigurationError(
            f"fence_redis_url: ssl_* query parameters need a rediss:// URL (got {first.scheme}://);"
            " use rediss://, or put the TLS options in fence_redis_ssl."
        )
    tls = first.scheme == "rediss" or bool(ssl_settings)
    if tls and first.scheme == "unix":
        raise ConfigurationError(
            "fence_redis_ssl / ssl_* options cannot be used with a unix:// fence_redis_url: "
            "a Unix socket is local; drop the TLS options or use rediss://."
        )
    if kind == "single":
        if first.scheme == "unix":
            path = unquote(first.path or "")
            if not path:
                raise ConfigurationError(
                    f"fence_redis_url={url!r} has no socket path: use 'unix:///run/redis.sock'."
                )
            options["unix_socket_path"] = path
        else:
            host, port = _address(first, DEFAULT_REDIS_PORT)
            options.update(host=host, port=port)
    if tls:
        options["ssl"] = True
        options.update(url_ssl)
        options.update(ssl_settings)  # the setting wins over the URL, as Celery's does

    sentinel_kwargs = options_raw.pop("sentinel_kwargs", None)
    master_name = options_raw.pop("master_name", None)
    min_other = options_raw.pop("min_other_sentinels", 0)
    options.update(options_raw)
    if kind == "sentinel":
        if not isinstance(master_name, str) or not master_name:
            raise ConfigurationError(
                "fence_redis_url uses sentinel:// but fence_redis_transport_options has no "
                "'master_name': set fence_redis_transport_options={'master_name': 'mymaster'} "
                "(the name in your sentinels' 'sentinel monitor' line)."
            )
        if sentinel_kwargs is not None and not isinstance(sentinel_kwargs, Mapping):
            raise ConfigurationError(
                "fence_redis_transport_options['sentinel_kwargs'] must be a dict of connection "
                "options for the sentinels themselves, e.g. {'password': '...'}."
            )
        if isinstance(min_other, bool) or not isinstance(min_other, int) or min_other < 0:
            raise ConfigurationError(
                "fence_redis_transport_options['min_other_sentinels'] must be a whole number >= 0."
            )
    return RedisTarget(
        kind=kind,
        nodes=tuple(nodes),
        options=options,
        master_name=master_name,
        sentinel_kwargs=dict(sentinel_kwargs) if sentinel_kwargs is not None else None,
        min_other_sentinels=min_other,
    )


def _timeouts(lease_ttl: float) -> dict[str, Any]:
    """Socket timeouts that let a renewal fail well inside one lease TTL, and one immediate
    retry (a stale pooled connection, a Sentinel failover) instead of redis-py's default
    retries with exponential backoff: those could hold a renewal round trip for seconds past
    the lease deadline. The renewer's next tick and the task's rescheduling are the retries."""
    timeout = max(0.5, min(5.0, lease_ttl / 3))
    return {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 1),
    }


def build_client(target: RedisTarget, *, lease_ttl: float) -> Any:
    """A redis-py client for ``target`` (no round trip is made here)."""
    options = {**_timeouts(lease_ttl), **target.options}
    if target.kind == "cluster":
        from redis.cluster import ClusterNode, RedisCluster

        options.pop("health_check_interval", None)  # not a cluster option in every redis-py
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            **options,
        )
    options.setdefault("health_check_interval", DEFAULT_HEALTH_CHECK_INTERVAL)
    if target.kind == "sentinel":
        from redis.sentinel import Sentinel

        sentinel_kwargs = {**_timeouts(lease_ttl), **(target.sentinel_kwargs or {})}
        sentinel = Sentinel(
            list(target.nodes),
            min_other_sentinels=target.min_other_sentinels,
            sentinel_kwargs=sentinel_kwargs,
            **options,
        )
        assert target.master_name is not None
        return sentinel.master_for(target.master_name, redis_class=redis.Redis)
    return redis.Redis(**options)


@dataclass(frozen=True, kw_only=True)
class RedisSettings:
    """The settings the Redis side is built from, as a value of its own (``FenceConfig.redis``
    reads them from ``fence_redis_*`` and ``fence_lease_ttl``, above this layer)."""

    url: str
    #: Seconds; the client's socket timeouts follow it (:func:`build_client`).
    lease_ttl: float
    #: ``fence_redis_client``: a callable returning a ready redis-py client (bypasses the rest).
    client: Callable[[], Any] | None = None
    cluster: bool = False
    ssl: Mapping[str, Any] | None = field(default=None, hash=False)
    transport_options: Mapping[str, Any] | None = field(default=None, hash=False)


def target_for(settings: RedisSettings) -> RedisTarget:
    return parse_redis_settings(
        settings.url,
        cluster=settings.cluster,
        ssl=settings.ssl,
        transport_options=settings.transport_options,
    )


def client_identity(settings: RedisSettings) -> tuple[Any, ...]:
    """What makes two settings' Redis clients interchangeable: URL, client factory, cluster mode,
    TLS and transport options (the lease store and the retry budget share by it)."""
    return (
        settings.url,
        settings.client,
        settings.cluster,
        repr(sorted((settings.ssl or {}).items())),
        repr(sorted((settings.transport_options or {}).items())),
    )


def make_client(settings: RedisSettings) -> Any:
    """The lease store's client: ``fence_redis_client()`` when set, else from the settings."""
    if settings.client is not None:
        return settings.client()
    return build_client(target_for(settings), lease_ttl=settings.lease_ttl)


__all__ = [
    "RedisSettings",
    "RedisTarget",
    "build_client",
    "make_client",
    "parse_redis_settings",
]
