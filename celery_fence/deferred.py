"""A deferred first registration (``fence_defer_first_registration``): a first claim writes no
row until it ends, so its completion is one statement. Any other ending, and a
``fence.transaction()`` block (whose ownership check is a statement on the row), registers it
late, here; the store's answer may turn the outcome into a replay, a dead job or a stale one.

Only a message's first delivery defers (the task decides): a re-sent or redelivered message may
find its job completed, and only a registration sees that. The setting needs counters that
never expire (``fence_generation_ttl=0``), or an expired counter would hand generation 1 to a
duplicate of a completed job.
"""

from __future__ import annotations

from .errors import StaleGeneration
from .outcomes import AlreadyDead, Attempt, Outcome, Replayed, Stale


def register_deferred(a: Attempt) -> None:
    """Before a ``fence.transaction()`` block of a deferred first claim: register it now (the
    block's ownership check is a statement on its row). Raises :class:`StaleGeneration` when the
    store says a newer generation (or a completion) got there first: the body stops, and the
    attempt settles as stale, converging on the stored result."""
    if not a.deferred:
        return
    outcome = register_late(a)
    if isinstance(outcome, Stale):
        raise outcome.error
    if outcome is not None:  # replayed or dead: the job was finished by another attempt
        record = getattr(outcome, "record", None)
        raise StaleGeneration(
            f"generation {a.generation} of {a.key!r} cannot write: the job is already finished",
            stored_generation=None if record is None else record.generation,
        )


def register_late(a: Attempt) -> Outcome | None:
    """Register a deferred first claim before an outcome that writes its row; None when it
    registered, else the outcome the store's state calls for."""
    assert a.generation is not None
    a.deferred = False
    registration = a.store.register(
        a.key,
        generation=a.generation,
        attempt_id=a.attempt_id,
        task_name=a.task_name,
        request_json=a.request_json,
    )
    a.attempts = registration.attempts
    if registration.outcome == "registered":
        return None
    if registration.outcome == "completed":
        assert registration.record is not None
        return Replayed(registration.record)
    if registration.outcome == "dead":
        return AlreadyDead(registration.record)
    return Stale(
        StaleGeneration(
            f"generation {a.generation} of {a.key!r} was superseded before it registered",
            stored_generation=registration.stored_generation,
        )
    )


__all__ = ["register_deferred", "register_late"]
