"""Every celery-fence setting's name, default and type, and how one is read from ``app.conf``:
the table :class:`~celery_fence.config.FenceConfig` is built from.

Every setting is lowercase and prefixed ``fence_`` like Celery's own (``fence_lease_ttl``); the
upper-case forms (``FENCE_LEASE_TTL``, and ``CELERY_FENCE_LEASE_TTL`` for Django's ``CELERY_``
namespace) are read too. A name with one of those prefixes that is no setting is an error that
names the closest real one (:func:`check_names`); a value of the wrong type is one that names the
setting as it was written (:func:`parse`). What a value must satisfy beyond its type (ranges,
settings that depend on each other) is :meth:`FenceConfig.validate`'s.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Mapping
from typing import Any

from celery_fence import django_port
from celery_fence.errors import ConfigurationError
from celery_fence.leases.limits import parse_rate

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
#: ``fence recover`` / the recover task: a ``retrying`` job, or a ``pending`` one recovery already
#: re-sent, whose lease is gone counts as stranded once it has not moved for this many lease TTLs
#: (unless ``fence_recover_after`` is set): its message may only be waiting in a queue. A
#: ``running`` job is stranded as soon as its lease is gone (renewed every fraction of the TTL,
#: its absence is the signal: a frozen or killed worker's job is taken over within one check of
#: its lease's end; see docs/design.md).
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
#: Parsed by a rule of their own in :func:`parse`.
_OTHERS = {
    "redis_client",
    "database",
    "unfenced_writes",
    "beat_missed",
    "transient_exceptions",
    "permanent_exceptions",
    "group",
    "rate_limit",
    "metrics_port",
    "metrics",
}
#: Every setting's name (without ``fence_``): the fields of :class:`~celery_fence.FenceConfig`
#: (``tests/unit/test_config.py`` checks they are the same names).
FIELD_NAMES = frozenset(
    {*_FLOATS, *_OPTIONAL_FLOATS, *_OPTIONAL_INTS, *_INTS, *_BOOLS, *_DICTS, *_STRS, *_OTHERS}
)


def parse(name: str, raw: Any, setting: str | None = None) -> Any:
    """Setting ``name``'s value ``raw`` as its type, or a :class:`ConfigurationError` naming it
    as written (``setting``; default ``fence_<name>``)."""
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


def task_fence_options(task: Any) -> list[str]:
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
        side = django_port.django_side(f"fence_database={alias!r} (a Django DATABASES alias)")
    except ImportError as exc:  # Django is not installed
        raise ConfigurationError(
            f"fence_database={alias!r} names a Django DATABASES alias, but Django cannot be "
            f"imported ({exc}): install celery-fence[django], or set fence_database_url instead."
        ) from None
    return side.url_for_alias(alias)


def lookup(conf: Mapping[str, Any], name: str) -> tuple[bool, Any, str]:
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
    found, raw, written = lookup(conf, f"fence_{name}")
    return parse(name, raw, written) if found else None


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


def as_written(message: str, written: Mapping[str, str]) -> str:
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
