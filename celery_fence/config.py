"""Settings, read once from ``app.conf`` into a validated, frozen :class:`FenceConfig`.

Every setting is lowercase and prefixed ``fence_`` like Celery's own (``fence_lease_ttl``); the
upper-case forms (``FENCE_LEASE_TTL``, and ``CELERY_FENCE_LEASE_TTL`` for Django's ``CELERY_``
namespace) are read too. Nothing falls back to ``broker_url``: the lease store is named on purpose.
"""

from __future__ import annotations

import dataclasses
import difflib
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


class Fenced:
    """The mark of a fenced task: :class:`~celery_fence.FencedTask` carries it. The operator
    side (recovery, the CLI) finds an app's fenced tasks by it and reads each one's settings
    with :meth:`FenceConfig.for_task`, without importing the Celery adapters."""

    __slots__ = ()


#: Redis that holds leases and generation counters.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: The embedded default result store: a SQLite file in the working directory.
DEFAULT_DATABASE_URL = "sqlite:///celery_fence.sqlite3"
#: Seconds a lease lives without renewal.
DEFAULT_LEASE_TTL = 30.0
#: Seconds between renewals; must be below the TTL (a third of it leaves two chances).
DEFAULT_RENEW_INTERVAL = 10.0
#: Prefix of every Redis key celery-fence writes.
DEFAULT_KEY_PREFIX = "fence"
#: Fraction of the TTL kept as a safety margin on the local lease deadline.
DEFAULT_LEASE_MARGIN = 0.1
#: Executions (claimed attempts) before a job goes to the terminal ``dead`` state.
DEFAULT_MAX_ATTEMPTS = 5
#: Base delay of the exponential backoff, seconds.
DEFAULT_RETRY_BACKOFF = 1.0
#: Cap of the backoff, seconds.
DEFAULT_RETRY_BACKOFF_MAX = 300.0
#: Outbox: delivery attempts (claims) of one effect before it goes ``dead``.
DEFAULT_OUTBOX_MAX_ATTEMPTS = 20
#: Outbox: base delay of the exponential backoff between two deliveries of one effect, seconds.
DEFAULT_OUTBOX_BACKOFF = 10.0
#: Outbox: cap of that backoff, seconds (retry ``n`` waits between half of
#: ``min(cap, base * 2 ** (n - 1))`` and all of it: about 5.7 to 11.4 hours in all, at the
#: defaults, before a failing effect is ``dead``).
DEFAULT_OUTBOX_BACKOFF_MAX = 3600.0
#: Retries allowed per task name, as a fraction of its recent calls ...
DEFAULT_RETRY_BUDGET_RATIO = 0.2
#: ... plus this many retries per budget window regardless of traffic.
DEFAULT_RETRY_BUDGET_FLOOR = 10
#: Budget window, seconds.
DEFAULT_RETRY_BUDGET_WINDOW = 60.0
#: Characters of an error message kept in the store.
DEFAULT_ERROR_MESSAGE_LENGTH = 500
#: Bytes of JSON one ``fence.checkpoint()`` may store: a position, not the data.
DEFAULT_CHECKPOINT_MAX_BYTES = 64 * 1024
#: Seconds any one database call may take (statement timeout, TCP user timeout, keepalive
#: detection, connect timeout and the client-side deadline all derive from it).
DEFAULT_DATABASE_TIMEOUT = 10.0
#: ``fence recover`` / the recover task: a non-terminal job whose lease is gone counts as
#: stranded once it has not moved for this many lease TTLs (unless ``fence_recover_after`` is set).
#: Three: a frozen or killed worker's job is taken over about three TTLs after its last move (a
#: re-send while the frozen worker still holds its message is fenced: see docs/design.md).
RECOVER_AFTER_TTLS = 3
#: Every fenced worker's own recovery check runs every this many lease TTLs (unless
#: ``fence_recover_interval`` is set): a stranded job waits at most about this long for a check.
RECOVER_INTERVAL_TTLS = 0.5
#: ``fence recover`` / the recover task: a job enqueued with :func:`~celery_fence.enqueue` and
#: never claimed (``pending``, generation 0) counts as stranded once it has not moved for this many
#: seconds (``fence_recover_pending_after``): no attempt has a lease on it to wait out. One still
#: waiting in a long broker backlog is sent a second time; the claim fences the two copies on
#: the key, so it completes once.
DEFAULT_RECOVER_PENDING_AFTER = 60.0
#: ``fence_retention``'s floor, seconds: a completed job's row must outlive any late redelivery.
MIN_RETENTION = 3600.0
#: A Django project (``celery_fence.contrib.django`` installed) that names no store: what
#: ``manage.py check`` (``celery_fence.E002``) and ``celery fence check`` say.
DJANGO_STORE_UNSET = (
    "CELERY_FENCE_DATABASE is not set (nor CELERY_FENCE_DATABASE_URL): celery-fence's store "
    "would be the embedded SQLite file celery_fence.sqlite3 in the working directory, not one "
    "of your DATABASES, and self.fence.atomic() refuses to run there. Set "
    'CELERY_FENCE_DATABASE = "default" (the DATABASES alias your models use) in settings.py, '
    "then run manage.py migrate."
)
#: PostgreSQL: seconds a store statement (a registration, a completion) waits for a row lock,
#: e.g. behind a paused ``fence.transaction()`` holder, before it fails and the message is re-sent.
DEFAULT_LOCK_TIMEOUT = 5.0
#: What a write a fenced body commits outside every fenced block gets: ``"warn"`` (one WARNING
#: per task name and process, an ``unfenced_write`` transition and signal), ``"error"`` (rolled
#: back, ``ConfigurationError``) or ``"allow"`` (nothing).
UNFENCED_WRITES = ("warn", "error", "allow")
DEFAULT_UNFENCED_WRITES = "warn"
#: What the beat scheduler (:mod:`celery_fence.beat`) does with the ticks an entry missed while
#: every replica was down: ``skip`` sends only the latest, ``catch_up`` sends each (at most
#: ``fence_beat_catch_up_max``, the latest ones), each under its own key.
BEAT_MISSED = ("skip", "catch_up")
DEFAULT_BEAT_MISSED = "skip"
#: ``catch_up``: the most missed ticks of one entry sent at once (the latest ones).
DEFAULT_BEAT_CATCH_UP_MAX = 10


def _as_float(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"{name}={value!r} is not a number of seconds: set it to a number like 30.0."
        ) from None


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigurationError(f"{name}={value!r} is not a whole number: set it to e.g. 5.")
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(
            f"{name}={value!r} is not a whole number: set it to e.g. 5."
        ) from None


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in {
        "1",
        "true",
        "yes",
        "on",
        "0",
        "false",
        "no",
        "off",
    }:
        return value.lower() in {"1", "true", "yes", "on"}
    raise ConfigurationError(f"{name}={value!r} is not a boolean: set it to True or False.")


def _as_types(name: str, value: Any) -> tuple[type[BaseException], ...]:
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple, set, frozenset)) else [value]
    out: list[type[BaseException]] = []
    for item in items:
        if isinstance(item, str):
            module, _, attr = item.rpartition(".")
            if not module:
                raise ConfigurationError(
                    f"{name}: {item!r} is not a dotted path; write 'package.module.ExceptionName'."
                )
            try:
                import importlib

                item = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError):
                raise ConfigurationError(
                    f"{name}: cannot import {item!r}; check the dotted path."
                ) from None
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise ConfigurationError(f"{name}: {item!r} is not an exception class.")
        out.append(item)
    return tuple(out)


#: Said when ``fence_defer_first_registration`` is set: the default path now waits for one
#: durable commit a task (the registration commits without waiting for its WAL flush), and the
#: deferral needed a read before the body that made it slower than the default (measured:
#: docs/performance.md). The setting is accepted so existing configurations keep working.
RETIRED_DEFERRAL = (
    "fence_defer_first_registration is retired and ignored: every task now waits for one "
    "durable commit (its completion; the registration no longer waits for its flush), which "
    "is what deferral was for, and faster. Remove the setting."
)


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
            found, raw, as_written = _lookup(conf, f"fence_{f.name}")
            if found:
                written[f.name] = as_written
                values[f.name] = _parse(f.name, raw, as_written)
        for name, raw in overrides.items():
            values[name] = _parse(name, raw)
        values["_renew_interval_given"] = "renew_interval" in values
        if "lease_ttl" in values and "renew_interval" not in values:
            values["renew_interval"] = derived_renew_interval(values["lease_ttl"])
        if values.get("database") is not None and "database_url" not in values:
            values["database_url"] = django_database_url(values["database"])
        try:
            return cls(**values)
        except ConfigurationError as exc:
            raise ConfigurationError(_as_written(str(exc), written)) from None

    @classmethod
    def for_task(cls, task: Any) -> FenceConfig:
        """The app's settings with the task's own options applied: ``lease_ttl``,
        ``renew_interval``, ``max_attempts`` and any ``fence_<setting>`` given to ``@app.task``."""
        base = cls.from_app(task.app)
        for attr in _task_fence_options(task):
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


_FLOATS = {
    "lease_ttl",
    "renew_interval",
    "lease_margin",
    "retry_backoff",
    "retry_backoff_max",
    "outbox_backoff",
    "outbox_backoff_max",
    "retry_budget_ratio",
    "retry_budget_window",
    "database_timeout",
    "generation_ttl",
    "lock_timeout",
    "recover_pending_after",
}
_OPTIONAL_FLOATS = {"recover_after", "recover_interval", "max_runtime", "retention"}
_OPTIONAL_INTS = {"group_limit"}
_INTS = {
    "max_attempts",
    "outbox_max_attempts",
    "retry_budget_floor",
    "error_message_length",
    "checkpoint_max_bytes",
    "beat_catch_up_max",
}
_BOOLS = {
    "retry_unknown_errors",
    "record_transitions",
    "send_events",
    "redact_celery_logs",
    "defer_first_registration",
    "redis_cluster",
}
_DICTS = {"redis_ssl", "redis_transport_options"}
_STRS = {"redis_url", "database_url", "key_prefix", "idempotency_namespace"}
_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{0,32}")
FIELD_NAMES = frozenset(
    f.name for f in dataclasses.fields(FenceConfig) if not f.name.startswith("_")
)


def _parse(name: str, raw: Any, setting: str | None = None) -> Any:
    setting = setting or f"fence_{name}"
    if name not in FIELD_NAMES:
        raise ConfigurationError(f"unknown celery-fence setting {setting!r}.")
    if name in _FLOATS:
        return _as_float(setting, raw)
    if name in _OPTIONAL_FLOATS:
        return None if raw is None else _as_float(setting, raw)
    if name in _INTS:
        return _as_int(setting, raw)
    if name in _OPTIONAL_INTS:
        return None if raw is None else _as_int(setting, raw)
    if name == "rate_limit":
        return None if raw is None else parse_rate(raw, setting).text
    if name == "metrics_port":
        return None if raw is None else _as_int(setting, raw)
    if name == "metrics":
        return None if raw is None else _as_bool(setting, raw)
    if name in _BOOLS:
        return _as_bool(setting, raw)
    if name == "database":  # a Django DATABASES alias, or None
        if raw is not None and not isinstance(raw, str):
            raise ConfigurationError(
                f"{setting}={raw!r} must be a DATABASES alias, e.g. 'default'."
            )
        return raw
    if name in ("unfenced_writes", "beat_missed"):  # any case; validate() names the values
        return raw.strip().lower() if isinstance(raw, str) else raw
    if name in _STRS:
        if not isinstance(raw, str):
            raise ConfigurationError(f"{setting}={raw!r} must be a string.")
        return raw
    if name in _DICTS:
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigurationError(
                f"{setting}={raw!r} must be a dict, e.g. "
                + (
                    "{'ssl_cert_reqs': 'required', 'ssl_ca_certs': '/etc/redis/ca.pem'}."
                    if name == "redis_ssl"
                    else "{'master_name': 'mymaster'}."
                )
            )
        return None if raw is None else dict(raw)
    if name == "redis_client":
        if raw is not None and not callable(raw):
            raise ConfigurationError(f"{setting} must be a callable returning a redis client.")
        return raw
    if name == "transient_exceptions":
        return None if raw is None else _as_types(setting, raw)
    if name == "permanent_exceptions":
        return _as_types(setting, raw)
    return raw


#: ``fence_*`` task options that are the task's API, not settings: its key and its uniqueness.
TASK_API = (
    "fence_key",
    "fence_unique",
    "fence_unique_states",
    "fence_unique_period",
    "fence_unique_on_conflict",
)


def _task_fence_options(task: Any) -> list[str]:
    """The ``fence_*`` options given to ``@app.task(...)``: class attributes of the task's own
    classes below the fenced base (whose ``fence_key``/``fence_config`` are its API)."""
    names: list[str] = []
    unwrap = getattr(task, "_get_current_object", None)  # a lazy task proxy
    for klass in type(task if unwrap is None else unwrap()).__mro__:
        if getattr(klass, "__module__", "").startswith(("celery_fence.", "celery.")):
            break
        names.extend(n for n in vars(klass) if n.startswith("fence_") and n not in TASK_API)
    return names


def django_database_url(alias: str) -> str:
    """The store URL of Django's ``DATABASES[alias]`` (``fence_database``), or a clear
    :class:`ConfigurationError`: Django missing or not configured, unknown alias, an engine the
    store does not run on."""
    try:
        from celery_fence.contrib.django.database import url_for_alias
    except ImportError as exc:  # Django is not installed
        raise ConfigurationError(
            f"fence_database={alias!r} names a Django DATABASES alias, but Django cannot be "
            f"imported ({exc}): install celery-fence[django], or set fence_database_url instead."
        ) from None
    return url_for_alias(alias)


def _lookup(conf: Mapping[str, Any], name: str) -> tuple[bool, Any, str]:
    """Whether ``name`` is set (in any of its three spellings), its value, and the spelling
    the user wrote (Celery's namespaced settings answer to every spelling: the one among the
    mapping's own keys is the one written)."""
    candidates = (name, name.upper(), "CELERY_" + name.upper())
    for candidate in candidates:
        try:
            value = conf[candidate]
        except KeyError:
            continue
        if value is not None:
            try:
                keys = set(conf.keys())
            except Exception:  # a mapping that cannot list its keys: as looked up
                return True, value, candidate
            written = next((c for c in reversed(candidates) if c in keys), candidate)
            return True, value, written
    return False, None, name


def read_setting(conf: Mapping[str, Any], name: str) -> Any:
    """One setting read and validated alone (None when unset), for what runs before any task
    validates them all (logging setup): ``read_setting(app.conf, "redact_celery_logs")``."""
    found, raw, written = _lookup(conf, f"fence_{name}")
    return _parse(name, raw, written) if found else None


#: The three spellings of a setting's prefix: Celery's, upper case, and Django's namespace.
_PREFIXES = ("fence_", "FENCE_", "CELERY_FENCE_")


def check_names(conf: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigurationError` for a name that looks like a celery-fence setting and
    is none, saying which real setting it probably meant."""
    try:
        names = list(conf.keys())
    except Exception:  # a mapping that cannot list its keys: nothing to check
        return
    for written in names:
        if not isinstance(written, str):
            continue
        prefix = next((p for p in reversed(_PREFIXES) if written.startswith(p)), None)
        if prefix is None:
            continue
        name = written[len(prefix) :].lower()
        if name in FIELD_NAMES:
            continue
        raise ConfigurationError(unknown_setting_message(written, prefix, name))


def unknown_setting_message(written: str, prefix: str, name: str) -> str:
    """``unknown celery-fence setting 'X': did you mean 'Y'?`` in the spelling used."""
    close = difflib.get_close_matches(name, sorted(FIELD_NAMES), n=1, cutoff=0.6)
    spell = (lambda n: prefix + n) if prefix == "fence_" else (lambda n: prefix + n.upper())
    hint = (
        f"did you mean {spell(close[0])!r}?"
        if close
        else "see the README's settings table for the names"
    )
    return f"unknown celery-fence setting {written!r}: {hint} (remove or rename it)"


def _as_written(message: str, written: Mapping[str, str]) -> str:
    """``message`` with each ``fence_<name>`` in the spelling the user wrote: as written for a
    setting they set, and for one they did not (a derived or default value the message names)
    in the spelling of the settings they did write (``CELERY_FENCE_RENEW_INTERVAL`` next to
    ``CELERY_FENCE_LEASE_TTL``)."""
    spellings = {
        next((p for p in reversed(_PREFIXES) if w.startswith(p)), "fence_")
        for w in written.values()
    }
    prefix = next((p for p in ("CELERY_FENCE_", "FENCE_") if p in spellings), "fence_")

    def spell(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in written:
            return written[name]
        if name not in FIELD_NAMES or prefix == "fence_":
            return match.group(0)
        return prefix + name.upper()

    return re.sub(r"\bfence_([a-z_]+[a-z])\b", spell, message)


def derived_renew_interval(lease_ttl: Any) -> Any:
    """``fence_renew_interval`` when only ``fence_lease_ttl`` is set: a third of the TTL (two
    renewals may fail before the lease's local deadline), as the defaults are (30 s, 10 s)."""
    return lease_ttl / 3 if isinstance(lease_ttl, (int, float)) and lease_ttl > 0 else lease_ttl


#: Task options that override a setting for one task without the ``fence_`` prefix:
#: ``@app.task(base=FencedTask, lease_ttl=5)``.
TASK_OPTIONS = frozenset({"lease_ttl", "renew_interval", "max_attempts"})
