"""Effects staged by a task body (``self.fence.effects.add(...)``) and their stable keys.

Nothing is written when an effect is staged: the fenced completion writes the staged effects in
its own statement/transaction, so a stale attempt's effects are never recorded and a completed
job's are recorded exactly once (:mod:`celery_fence.ops.outbox` delivers them). An effect's
idempotency key is derived from the logical key and the effect's name — the same across every
retry and redelivery. A run an operator started on purpose (``fence requeue --completed``) is
numbered (the message's ``fence_run`` header, 1, 2, ...): its effects get keys of their own, with
the run number in them, so they are recorded and delivered; the first run's keys never change.
"""

from __future__ import annotations

import hashlib
from typing import Any

from celery_fence.errors import FenceError
from celery_fence.store.records import Effect, dumps_strict


def idempotency_key(key: str, name: str, run: int = 0, *, namespace: str = "") -> str:
    """A stable key for effect ``name`` of logical job ``key`` (never attempt-specific).

    ``run``: the operator's re-run it belongs to (``fence requeue --completed``: 1, 2, ...); 0,
    the key's first run, keeps the key every earlier version gave, so a provider's dedupe of
    effects recorded before still holds. ``namespace`` (``fence_idempotency_namespace``, e.g.
    ``"staging"``) is part of the key, so two environments sharing one provider account never
    send the same key for their own jobs of the same name; empty (the default) gives the keys of
    earlier versions."""
    text = f"{key}\x00{name}" if not run else f"{key}\x00{name}\x00run:{int(run)}"
    if not namespace:
        return f"fence-{hashlib.sha256(text.encode()).hexdigest()[:48]}"
    digest = hashlib.sha256(f"{namespace}\x00{text}".encode()).hexdigest()
    return f"fence-{namespace}-{digest[:48]}"


def storage_key(key: str, version: str | int, *, prefix: str = "exports", suffix: str = "") -> str:
    """A deterministic object key for an export-style job: same input version, same object.

    Re-runs of one (key, version) replace the same object; a new input version writes a new one.
    """
    digest = hashlib.sha256(f"{key}\x00{version}".encode()).hexdigest()[:32]
    return f"{prefix}/{digest}{suffix}"


class StagedEffects:
    """The effects one attempt stages (``self.fence.effects``); written only by a successful
    fenced completion, as rows of ``fence_outbox``."""

    def __init__(self, key: str, run: int = 0, namespace: str = "") -> None:
        self.key = key
        #: The operator's re-run this attempt belongs to (0: the key's first run).
        self.run = run
        self.namespace = namespace
        self._effects: dict[str, Effect] = {}

    def add(self, name: str, payload: Any = None) -> str:
        """Stage effect ``name`` with a JSON payload; return its idempotency key."""
        if not isinstance(name, str) or not name or len(name) > 255:
            raise FenceError(f"outbox effect name {name!r} must be a non-empty str of <= 255 chars")
        if name in self._effects:
            raise FenceError(
                f"outbox effect {name!r} is already staged for {self.key!r}: names are unique per "
                "job (they make the idempotency key); use e.g. 'email:alice' and 'email:bob'"
            )
        dumps_strict(payload, f"payload of outbox effect {name!r}")
        idem = idempotency_key(self.key, name, self.run, namespace=self.namespace)
        effect = Effect(name=name, payload=payload, idempotency_key=idem)
        self._effects[name] = effect
        return effect.idempotency_key

    @property
    def staged(self) -> tuple[Effect, ...]:
        return tuple(self._effects.values())

    def __len__(self) -> int:
        return len(self._effects)


__all__ = ["StagedEffects", "idempotency_key", "storage_key"]
