"""Settings, read once from ``app.conf`` into a validated, frozen :class:`FenceConfig`.

Each setting's name, default and type, and how it is read (its three spellings, the check of
misspelt names), are :mod:`celery_fence.settings`'; this module holds the value they are read
into and what each value must satisfy. Nothing falls back to ``broker_url``: the lease store is
named on purpose.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from celery_fence.app_state import AppSlot
from celery_fence.errors import ConfigurationError
from celery_fence.leases.lease import DEFAULT_GENERATION_TTL  # (the lease's own default)
from celery_fence.leases.limits import MAX_GROUP_LIMIT, Rate, parse_rate
from celery_fence.leases.redis_client import RedisSettings, parse_redis_settings
from celery_fence.settings import (
    BEAT_MISSED,
    DEFAULT_BEAT_CATCH_UP_MAX,
    DEFAULT_BEAT_MISSED,
    DEFAULT_CHECKPOINT_MAX_BYTES,
    DEFAULT_DATABASE_TIMEOUT,
    DEFAULT_DATABASE_URL,
    DEFAULT_ERROR_MESSAGE_LENGTH,
    DEFAULT_KEY_PREFIX,
    DEFAULT_LEASE_MARGIN,
    DEFAULT_LEASE_TTL,
    DEFAULT_LOCK_TIMEOUT,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_OUTBOX_BACKOFF,
    DEFAULT_OUTBOX_BACKOFF_MAX,
    DEFAULT_OUTBOX_MAX_ATTEMPTS,
    DEFAULT_RECOVER_PENDING_AFTER,
    DEFAULT_REDIS_URL,
    DEFAULT_RENEW_INTERVAL,
    DEFAULT_RETRY_BACKOFF,
    DEFAULT_RETRY_BACKOFF_MAX,
    DEFAULT_RETRY_BUDGET_FLOOR,
    DEFAULT_RETRY_BUDGET_RATIO,
    DEFAULT_RETRY_BUDGET_WINDOW,
    DEFAULT_UNFENCED_WRITES,
    FIELD_NAMES,
    MIN_RETENTION,
    RECOVER_AFTER_TTLS,
    RECOVER_INTERVAL_TTLS,
    RETIRED_DEFERRAL,
    TASK_OPTIONS,
    UNFENCED_WRITES,
    as_written,
    check_names,
    derived_renew_interval,
    django_database_url,
    lookup,
    parse,
    task_fence_options,
    unknown_setting_message,
)


class Fenced:
    """The mark of a fenced task: :class:`~celery_fence.FencedTask` carries it. The operator
    side (recovery, the CLI) finds an app's fenced tasks by it and reads each one's settings
    with :meth:`FenceConfig.for_task`, without importing the Celery adapters."""

    __slots__ = ()


@dataclasses.dataclass(frozen=True)
class FenceConfig:
    """The validated settings. Build one with :meth:`from_app` or :meth:`from_mapping`."""

    redis_url: str = DEFAULT_REDIS_URL
    redis_client: Callable[[], Any] | None = None
    # Redis topology (see celery_fence.leases.redis_client): a Cluster, TLS options, Sentinel
    # options.
    redis_cluster: bool = False
    redis_ssl: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)
    redis_transport_options: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)
    database_url: str = DEFAULT_DATABASE_URL
    #: A Django ``DATABASES`` alias: the store is built from its settings (when no
    #: ``fence_database_url`` is given). See :mod:`celery_fence.contrib.django`.
    database: str | None = None
    lease_ttl: float = DEFAULT_LEASE_TTL
    renew_interval: float = DEFAULT_RENEW_INTERVAL
    lease_margin: float = DEFAULT_LEASE_MARGIN
    key_prefix: str = DEFAULT_KEY_PREFIX
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    retry_backoff: float = DEFAULT_RETRY_BACKOFF
    retry_backoff_max: float = DEFAULT_RETRY_BACKOFF_MAX
    outbox_max_attempts: int = DEFAULT_OUTBOX_MAX_ATTEMPTS
    outbox_backoff: float = DEFAULT_OUTBOX_BACKOFF
    outbox_backoff_max: float = DEFAULT_OUTBOX_BACKOFF_MAX
    retry_budget_ratio: float = DEFAULT_RETRY_BUDGET_RATIO
    retry_budget_floor: int = DEFAULT_RETRY_BUDGET_FLOOR
    retry_budget_window: float = DEFAULT_RETRY_BUDGET_WINDOW
    permanent_exceptions: tuple[type[BaseException], ...] = ()
    transient_exceptions: tuple[type[BaseException], ...] | None = None  # None: the defaults
    retry_unknown_errors: bool = True
    error_message_length: int = DEFAULT_ERROR_MESSAGE_LENGTH
    checkpoint_max_bytes: int = DEFAULT_CHECKPOINT_MAX_BYTES
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    record_transitions: bool = True
    send_events: bool = True
    redact_celery_logs: bool = False
    defer_first_registration: bool = False  # retired: accepted, ignored (RETIRED_DEFERRAL)
    database_timeout: float = DEFAULT_DATABASE_TIMEOUT
    generation_ttl: float = DEFAULT_GENERATION_TTL
    recover_after: float | None = None  # None: RECOVER_AFTER_TTLS x lease_ttl
    recover_pending_after: float = DEFAULT_RECOVER_PENDING_AFTER
    #: Seconds between two recovery checks a worker runs itself (its main process, with
    #: jitter; one check per interval across the workers sharing the lease Redis). None: half
    #: the lease TTL; 0: off (schedule ``celery_fence.recover`` in beat instead).
    recover_interval: float | None = None
    max_runtime: float | None = None  # None: the task's hard time limit, if it has one
    retention: float | None = None  # None: finished jobs are kept until purged by hand
    unfenced_writes: str = DEFAULT_UNFENCED_WRITES
    #: The beat scheduler's missed-tick policy (:data:`BEAT_MISSED`) and its catch-up bound.
    beat_missed: str = DEFAULT_BEAT_MISSED
    beat_catch_up_max: int = DEFAULT_BEAT_CATCH_UP_MAX
    #: Whether ``renew_interval`` was set (False: it follows ``lease_ttl``, a third of it, also
    #: for a task that sets its own ``lease_ttl``).
    _renew_interval_given: bool = dataclasses.field(default=True, compare=False, repr=False)
    #: Part of every outbox idempotency key: environments (staging, production) sharing one
    #: provider account set different namespaces so their keys never collide. Empty: the keys
    #: of earlier versions, unchanged.
    idempotency_namespace: str = ""
    #: A concurrency group (a task option): a str, or a callable given the task's ``(args,
    #: kwargs)`` returning one. With ``group_limit``, at most that many attempts of the group run
    #: at once across all workers; with ``rate_limit``, the group shares one bucket.
    group: str | Callable[[tuple[Any, ...], dict[str, Any]], str] | None = None
    #: Slots of the concurrency group: attempts of one group running at once, cluster-wide.
    group_limit: int | None = None
    #: A cluster-wide rate limit ("10/s", "100/m", "1000/h") for the task, or its group.
    rate_limit: str | None = None
    #: The port a worker serves Prometheus's ``/metrics`` on (its main process); None: none.
    metrics_port: int | None = None
    #: Prometheus metrics on (True), off (False), or None: on when ``prometheus_client`` is
    #: importable and ``metrics_port`` or ``PROMETHEUS_MULTIPROC_DIR`` is set
    #: (:func:`celery_fence.metrics.wanted`).
    metrics: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def lease_ttl_ms(self) -> int:
        return round(self.lease_ttl * 1000)

    @property
    def generation_ttl_ms(self) -> int:
        """Milliseconds a generation counter lives after its last claim; 0 means forever."""
        return round(self.generation_ttl * 1000)

    @property
    def recover_after_seconds(self) -> float:
        """Seconds without movement after which a job whose lease is gone is stranded."""
        if self.recover_after is not None:
            return self.recover_after
        return RECOVER_AFTER_TTLS * self.lease_ttl

    @property
    def recover_interval_seconds(self) -> float:
        """Seconds between a worker's own recovery checks (0: the worker runs none)."""
        if self.recover_interval is not None:
            return self.recover_interval
        return RECOVER_INTERVAL_TTLS * self.lease_ttl

    @property
    def recover_pending_after_seconds(self) -> float:
        """Seconds without movement after which a never-claimed enqueued job is stranded (never
        more than :attr:`recover_after_seconds`)."""
        return min(self.recover_pending_after, self.recover_after_seconds)

    @property
    def rate(self) -> Rate | None:
        """``rate_limit`` parsed (None: no rate limit)."""
        return None if self.rate_limit is None else parse_rate(self.rate_limit)

    def validate(self) -> None:
        self._validate_limits()
        if self.lease_ttl <= 0:
            raise ConfigurationError(
                f"fence_lease_ttl={self.lease_ttl} must be positive: set it to the seconds a lease "
                "may live without renewal, e.g. 30.0."
            )
        if not 0 <= self.lease_margin < 0.5:
            raise ConfigurationError(
                f"fence_lease_margin={self.lease_margin} must be a fraction in [0, 0.5), e.g. 0.1."
            )
        usable = self.lease_ttl * (1.0 - self.lease_margin)
        if not 0 < self.renew_interval < usable:
            raise ConfigurationError(
                f"fence_renew_interval={self.renew_interval} must be positive and less than "
                f"fence_lease_ttl x (1 - fence_lease_margin) = {usable:g}, or a lease's local "
                "deadline passes before its next renewal is even sent: set it to about a third "
                f"of the TTL (e.g. fence_renew_interval={self.lease_ttl / 3:g})."
            )
        if not _NAMESPACE.fullmatch(self.idempotency_namespace):
            raise ConfigurationError(
                f"fence_idempotency_namespace={self.idempotency_namespace!r} must be at most 32 "
                "letters, digits, '.', '_' or '-' (or empty, the default): name the environment "
                "that shares a provider account with others, e.g. 'staging'."
            )
        if not self.key_prefix or any(c in self.key_prefix for c in "{} "):
            raise ConfigurationError(
                f"fence_key_prefix={self.key_prefix!r} must be non-empty, without spaces or braces "
                "(braces are Redis Cluster hash tags): e.g. 'fence'."
            )
        if self.checkpoint_max_bytes < 1:
            raise ConfigurationError(
                f"fence_checkpoint_max_bytes={self.checkpoint_max_bytes} must be a positive "
                "number of bytes (the largest JSON one fence.checkpoint() stores), e.g. "
                f"{DEFAULT_CHECKPOINT_MAX_BYTES}."
            )
        if self.max_attempts < 1:
            raise ConfigurationError(f"fence_max_attempts={self.max_attempts} must be at least 1.")
        if self.retry_backoff < 0 or self.retry_backoff_max < self.retry_backoff:
            raise ConfigurationError(
                f"fence_retry_backoff={self.retry_backoff} must be >= 0 and at most "
                f"fence_retry_backoff_max={self.retry_backoff_max}."
            )
        if self.outbox_max_attempts < 1:
            raise ConfigurationError(
                f"fence_outbox_max_attempts={self.outbox_max_attempts} must be at least 1 (the "
                "deliveries of one outbox effect before it goes dead), e.g. "
                f"{DEFAULT_OUTBOX_MAX_ATTEMPTS}."
            )
        if not self.outbox_backoff > 0:
            raise ConfigurationError(
                f"fence_outbox_backoff={self.outbox_backoff} must be a positive number of seconds "
                "(the first wait before an outbox effect that failed is delivered again), e.g. "
                f"{DEFAULT_OUTBOX_BACKOFF:g}."
            )
        if not self.outbox_backoff_max >= self.outbox_backoff:
            raise ConfigurationError(
                f"fence_outbox_backoff_max={self.outbox_backoff_max} must be at least "
                f"fence_outbox_backoff={self.outbox_backoff} (it caps the waits between two "
                f"deliveries of a failing outbox effect), e.g. {DEFAULT_OUTBOX_BACKOFF_MAX:g}."
            )
        if not self.retry_budget_ratio >= 0 or self.retry_budget_floor < 0:
            raise ConfigurationError(
                "fence_retry_budget_ratio and fence_retry_budget_floor must not be negative."
            )
        if self.retry_budget_window <= 0:
            raise ConfigurationError(
                "fence_retry_budget_window must be a positive number of seconds."
            )
        if not self.database_timeout > 0:
            raise ConfigurationError(
                f"fence_database_timeout={self.database_timeout} must be a positive number of "
                "seconds (the longest one database call may take), e.g. 10.0."
            )
        if not (self.generation_ttl == 0 or self.generation_ttl >= self.lease_ttl):
            raise ConfigurationError(
                f"fence_generation_ttl={self.generation_ttl} must be 0 (counters never expire) "
                f"or at least fence_lease_ttl={self.lease_ttl}, e.g. 600.0."
            )
        if self.defer_first_registration:
            warnings.warn(RETIRED_DEFERRAL, FutureWarning, stacklevel=2)
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ConfigurationError(
                f"fence_metrics_port={self.metrics_port} is not a TCP port: set it to a free "
                "port such as 9808, or None to serve no /metrics."
            )
        if self.recover_after is not None and not self.recover_after >= 2 * self.lease_ttl:
            raise ConfigurationError(
                f"fence_recover_after={self.recover_after} must be at least twice "
                f"fence_lease_ttl={self.lease_ttl} (a job is stranded only once its lease is long "
                f"gone), e.g. {RECOVER_AFTER_TTLS * self.lease_ttl:g}."
            )
        if not self.recover_pending_after > 0:
            raise ConfigurationError(
                f"fence_recover_pending_after={self.recover_pending_after} must be a positive "
                "number of seconds (how long a never-claimed enqueued job may wait for its first "
                f"claim before recovery sends it again), e.g. {DEFAULT_RECOVER_PENDING_AFTER:g}."
            )
        if self.recover_interval is not None and not self.recover_interval >= 0:
            raise ConfigurationError(
                f"fence_recover_interval={self.recover_interval} must be a number of seconds "
                "(between two recovery checks a worker runs itself), 0 to turn them off, or "
                f"None (half the lease TTL, e.g. {RECOVER_INTERVAL_TTLS * self.lease_ttl:g})."
            )
        if self.max_runtime is not None and not self.max_runtime > 0:
            raise ConfigurationError(
                f"fence_max_runtime={self.max_runtime} must be a positive number of seconds, or "
                "None (the task's hard time limit, if any)."
            )
        if self.retention is not None and not self.retention >= MIN_RETENTION:
            raise ConfigurationError(
                f"fence_retention={self.retention} must be at least {MIN_RETENTION:g} seconds: a "
                "completed job's row is what makes a late redelivery replay its result instead of "
                "running the body again, so keep it longer than any message can be delayed, e.g. "
                "fence_retention=7 * 86400 (a week), or unset it to keep everything."
            )
        if self.lock_timeout <= 0:
            raise ConfigurationError(
                f"fence_lock_timeout={self.lock_timeout} must be a positive number of seconds "
                "(the longest a store statement waits for a row lock), e.g. "
                f"{DEFAULT_LOCK_TIMEOUT}."
            )
        if self.unfenced_writes not in UNFENCED_WRITES:
            raise ConfigurationError(
                f"fence_unfenced_writes={self.unfenced_writes!r} must be one of 'warn' (the "
                "default: log and record a write a fenced task commits outside every fenced "
                "block), 'error' (roll it back and raise) or 'allow' (say nothing)."
            )
        if self.beat_missed not in BEAT_MISSED:
            raise ConfigurationError(
                f"fence_beat_missed={self.beat_missed!r} must be 'skip' (the default: after every "
                "beat replica was down, send only an entry's latest missed tick) or 'catch_up' "
                "(send each missed tick, at most fence_beat_catch_up_max of them)."
            )
        if self.beat_catch_up_max < 1:
            raise ConfigurationError(
                f"fence_beat_catch_up_max={self.beat_catch_up_max} must be at least 1 (the most "
                "missed ticks of one entry that catch_up sends), e.g. "
                f"{DEFAULT_BEAT_CATCH_UP_MAX}."
            )
        if "://" not in self.database_url:
            raise ConfigurationError(
                f"fence_database_url={self.database_url!r} is not an SQLAlchemy URL: use e.g. "
                "'sqlite:///celery_fence.sqlite3' or 'postgresql+psycopg://user@host/db'."
            )
        if self.redis_client is None:  # the escape hatch's client is the user's to configure
            parse_redis_settings(
                self.redis_url,
                cluster=self.redis_cluster,
                ssl=self.redis_ssl,
                transport_options=self.redis_transport_options,
            )

    def _validate_limits(self) -> None:
        if self.group is not None and not (
            callable(self.group) or (isinstance(self.group, str) and self.group)
        ):
            raise ConfigurationError(
                f"fence_group={self.group!r} must be a non-empty str, or a callable given the "
                "task's (args, kwargs) returning one, e.g. fence_group=lambda args, kwargs: "
                "f\"tenant:{kwargs['tenant']}\"."
            )
        if self.group_limit is not None:
            if not 1 <= self.group_limit <= MAX_GROUP_LIMIT:
                raise ConfigurationError(
                    f"fence_group_limit={self.group_limit} must be an int from 1 to "
                    f"{MAX_GROUP_LIMIT}: how many attempts of the group may run at once."
                )
            if self.group is None:
                raise ConfigurationError(
                    f"fence_group_limit={self.group_limit} needs a group: set fence_group (a str, "
                    "or a callable given (args, kwargs)) on the task too."
                )
        if self.rate_limit is not None:
            parse_rate(self.rate_limit)

    @classmethod
    def from_mapping(cls, conf: Mapping[str, Any], **overrides: Any) -> FenceConfig:
        """Read ``fence_*`` settings from a Celery ``app.conf`` (or any mapping).

        A name with a celery-fence prefix that is no setting (a typo such as
        ``CELERY_FENCE_LEASE_TIL``) is an error, with the closest real name; errors name a
        setting the way it was written."""
        check_names(conf)
        values: dict[str, Any] = {}
        written: dict[str, str] = {}
        for f in dataclasses.fields(cls):
            found, raw, spelled = lookup(conf, f"fence_{f.name}")
            if found:
                written[f.name] = spelled
                values[f.name] = parse(f.name, raw, spelled)
        for name, raw in overrides.items():
            values[name] = parse(name, raw)
        values["_renew_interval_given"] = "renew_interval" in values
        if "lease_ttl" in values and "renew_interval" not in values:
            values["renew_interval"] = derived_renew_interval(values["lease_ttl"])
        if values.get("database") is not None and "database_url" not in values:
            values["database_url"] = django_database_url(values["database"])
        try:
            return cls(**values)
        except ConfigurationError as exc:
            raise ConfigurationError(as_written(str(exc), written)) from None

    @classmethod
    def for_task(cls, task: Any) -> FenceConfig:
        """The app's settings with the task's own options applied: ``lease_ttl``,
        ``renew_interval``, ``max_attempts`` and any ``fence_<setting>`` given to ``@app.task``."""
        base = cls.from_app(task.app)
        for attr in task_fence_options(task):
            if attr[len("fence_") :] not in FIELD_NAMES:
                message = unknown_setting_message(attr, "fence_", attr[len("fence_") :])
                raise ConfigurationError(f"task {task.name}: {message}")
        overrides: dict[str, Any] = {}
        for name in FIELD_NAMES:
            value = getattr(task, f"fence_{name}", None)
            if name in TASK_OPTIONS and getattr(task, name, None) is not None:
                value = getattr(task, name)
            if name == "group" and inspect.ismethod(value):  # a function option, bound on access
                value = value.__func__
            if value is not None:
                overrides[name] = value
        if not overrides:
            return base
        current = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        del current["_renew_interval_given"]
        if not base._renew_interval_given and "renew_interval" not in overrides:
            del current["renew_interval"]  # it follows the TTL: the task's own, if it has one
        try:
            return cls.from_mapping({}, **{**current, **overrides})
        except ConfigurationError as exc:
            raise ConfigurationError(f"task {task.name}: {exc}") from None

    @classmethod
    def from_app(cls, app: Any) -> FenceConfig:
        """The app's settings, read once (:meth:`forget` them to read them again)."""
        config = _APP_CONFIG.get(app)
        if config is None:
            config = cls.from_mapping(app.conf)
            _APP_CONFIG.set(app, config)
        return config

    @staticmethod
    def forget(app: Any) -> None:
        """Forget the settings :meth:`from_app` read for ``app`` (the next call reads them)."""
        _APP_CONFIG.set(app, None)

    @functools.cached_property
    def redis(self) -> RedisSettings:
        """The settings the Redis side is built from, as the leases layer takes them."""
        return RedisSettings(
            url=self.redis_url,
            lease_ttl=self.lease_ttl,
            client=self.redis_client,
            cluster=self.redis_cluster,
            ssl=self.redis_ssl,
            transport_options=self.redis_transport_options,
        )


#: The settings :meth:`FenceConfig.from_app` read, kept on each app.
_APP_CONFIG: AppSlot[FenceConfig] = AppSlot("config")


_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{0,32}")
