"""Every exception celery-fence raises, under one root, :class:`FenceError`; except
:class:`RetryNotSent`, which is Celery's control flow (a ``Reject``).

Each class's :attr:`~FenceError.default` is its message when none is given, so ``raise
LeaseLost()`` still says something useful.
"""

from __future__ import annotations

from typing import ClassVar

from celery.exceptions import Reject


class FenceError(Exception):
    """A celery-fence error."""

    #: The message when none is given.
    default: ClassVar[str] = "a celery-fence error"

    def __init__(self, message: str | None = None, **context: object) -> None:
        self.context = context
        super().__init__(message or self.default)


class ConfigurationError(FenceError):
    """A celery-fence setting is missing or invalid."""

    default = "a celery-fence setting is missing or invalid"


class CheckpointTooLarge(ConfigurationError):
    """A ``fence.checkpoint()`` value is larger than ``fence_checkpoint_max_bytes``."""

    default = (
        "the checkpoint is larger than fence_checkpoint_max_bytes: store a position (an id, an "
        "offset), not the data, or raise the setting"
    )


class LeaseError(FenceError):
    """The Redis lease for a key could not be used."""

    default = "the Redis lease for a key could not be used"


class LeaseLost(LeaseError):
    """The lease was lost: this attempt must not start new side effects."""

    default = "the lease was lost: this attempt must not start new side effects"


class LeaseBusy(LeaseError):
    """Another attempt holds a live lease for this key."""

    default = "another attempt holds a live lease for this key"

    def __init__(self, message: str | None = None, *, remaining: float = 0.0, **ctx: object):
        self.remaining = remaining  # seconds left on the holder's lease
        super().__init__(message, remaining=remaining, **ctx)


class StoreError(FenceError):
    """The result store refused an operation."""

    default = "the result store refused an operation"


class StaleGeneration(StoreError):
    """A newer generation owns this key: the write from the older one was rejected."""

    default = "a newer generation owns this key: the write from the older one was rejected"


class BlockIdleTimeout(StoreError):
    """PostgreSQL ended a fenced block's transaction: it stayed idle between two statements
    longer than ``fence_lease_ttl`` (the block's ``idle_in_transaction_session_timeout``).
    Nothing of the block committed; do slow work before the block."""

    default = (
        "a fenced block stayed idle between two statements longer than fence_lease_ttl and "
        "PostgreSQL ended its transaction: do slow work before the block"
    )


class JobDead(StoreError):
    """The job is in the terminal ``dead`` state; requeue it with ``celery fence requeue``."""

    default = "the job is dead; requeue it with `celery fence requeue KEY`"


class AlreadyEnqueued(StoreError):
    """An unfinished job (pending, running or retrying) already holds this uniqueness key, and
    the enqueue asked for ``on_conflict="raise"``. ``key``, ``unique_key``, ``status`` and
    ``task_id`` name that job."""

    default = "an unfinished job already holds this uniqueness key"

    def __init__(
        self,
        message: str | None = None,
        *,
        key: str = "",
        unique_key: str = "",
        status: str = "",
        task_id: str | None = None,
    ) -> None:
        super().__init__(message, key=key, unique_key=unique_key, status=status)
        self.key = key
        self.unique_key = unique_key
        self.status = status
        self.task_id = task_id


class ResultNotSerializable(StoreError):
    """The task's return value is not JSON; return plain dicts, lists, str, int, float, bool."""

    default = (
        "the task's return value is not JSON; return plain dicts, lists, str, int, float, bool"
    )


class Rescheduled(FenceError):
    """celery-fence re-sent this message (lease busy, store unavailable, newer generation); for
    a call in the caller's thread (a direct call, ``.apply()``, an eager run), which has no
    message to re-send, the reason it did not run, raised to the caller."""

    default = "celery-fence re-sent this message"


class RetryNotSent(Reject):
    """The broker refused the retry message of ``self.retry()`` (or of a fence re-send): the
    original message goes back to the broker (a requeue) instead of being rejected for good.

    Celery's own control flow, not a :class:`FenceError`: Celery requeues the message."""

    def __init__(self, reason: object = None, requeue: bool = True) -> None:
        super().__init__(reason, requeue=requeue)


class PermanentError(FenceError):
    """Raised by a task body: this input will never succeed, so do not retry it."""

    default = "this input will never succeed: not retried"


class FenceEagerWarning(UserWarning):
    """A fenced task ran eagerly (``task_always_eager`` or ``.apply()``): no worker, no lease
    renewal, no redelivery, so its fencing is not exercised; test it with real workers."""
