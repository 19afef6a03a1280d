"""Flower shows the fence: key, generation, and which attempt of a task id counted.

A takeover's re-send reuses the Celery task id (callers' ``AsyncResult`` converges on one
result), so one Flower task can hold two attempts: the stale one, paused past its lease, and the
one that counted. Celery's own events cannot tell them apart — the stale attempt converges on the
stored result and ends ``SUCCESS`` like the other (that return value is what the result backend
holds for the task id: it must stay the counted result) — and Flower's task page and
``/api/task/info/<id>`` print only Celery's fixed list of fields (``Task._fields``), so the
``fence_key``/``generation``/``attempt_id`` that every ``task-fence*`` event carries reach
Flower's memory but are never displayed.

:func:`install`, run in Flower's process (its config file, ``celery flower
--conf=flowerconfig.py``)::

    # flowerconfig.py
    from celery_fence.contrib.flower import install
    install()

makes Flower keep, per task id, one entry per fenced attempt (built from the ``task-fence*``
events, whatever order they arrive in) and show five more fields on the task page and in the API:

``fence_key``         the job's key
``fence_generation``  the generation that counted (completed), else the highest seen
``fence_counted``     ``generation 2, attempt <id> on <worker>``: the attempt whose result stands
``fence_stale``       ``generation 1, attempt <id> on <worker>: stored generation 2`` for each
                      attempt the store rejected (``None`` when there was none)
``fence_attempts``    every attempt: ``generation 1 <id> on <worker>: stale (...)``, in order of
                      generation

Celery's ``state`` stays Celery's (``SUCCESS``), and its ``worker`` is the host of the task's
latest event, which may be the stale attempt's: read ``fence_counted`` for the one that counted.
Nothing here touches args, kwargs or results: only key, attempt id, generation, reason, host.
"""

from __future__ import annotations

from typing import Any

from celery.events.state import Task

from celery_fence.announce.events import EVENT_PREFIX

#: The subject of a fence event in Celery's event state: ``fenceclaimed``, ``fencestale``, ...
SUBJECT_PREFIX = EVENT_PREFIX.split("-", 1)[1]
#: The fields :class:`FencedTaskView` adds to Flower's task page and ``/api/task/info``.
FENCE_FIELDS = ("fence_key", "fence_generation", "fence_counted", "fence_stale", "fence_attempts")

# What an attempt's latest fence event says about it, and how final that is: a late renewal
# never hides a completion or a stale rejection (events of two processes arrive in any order).
_VERDICTS: dict[str, tuple[int, str]] = {
    "claimed": (0, "running"),
    "renewed": (0, "running"),
    "busy": (1, "busy"),
    "retry": (1, "retry scheduled"),
    "lost": (1, "lease lost"),
    "replayed": (2, "replayed the stored result"),
    "dead": (2, "dead"),
    "stale": (3, "stale"),
    "completed": (3, "completed (counted)"),
}


class FencedTaskView(Task):
    """Celery's event-state task with its fence attempts (``fence``: attempt id -> entry)."""

    _fields = (*Task._fields, "fence", *FENCE_FIELDS)
    fence: dict[str, dict[str, Any]] | None = None

    def event(
        self,
        type_: str,
        timestamp: float | None = None,
        local_received: float | None = None,
        fields: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        if type_.startswith(SUBJECT_PREFIX) and fields:
            self._note(type_[len(SUBJECT_PREFIX) :], fields)
        super().event(type_, timestamp, local_received, fields, **options)

    def _note(self, action: str, fields: dict[str, Any]) -> None:
        rank, verdict = _VERDICTS.get(action, (0, action))
        attempt = str(fields.get("attempt_id") or f"(no attempt, {action})")
        fence = self.fence = dict(self.fence or {})
        entry = dict(fence.get(attempt) or {"rank": -1})
        entry["key"] = fields.get("fence_key", entry.get("key"))
        if fields.get("generation") is not None:
            entry["generation"] = fields["generation"]
        entry["worker"] = fields.get("hostname", entry.get("worker"))
        if rank >= entry["rank"]:
            entry.update(rank=rank, verdict=verdict, reason=fields.get("reason"))
        fence[attempt] = entry

    def _entries(self) -> list[tuple[str, dict[str, Any]]]:
        entries = list((self.fence or {}).items())
        return sorted(entries, key=lambda item: (item[1].get("generation") or 0, item[0]))

    @staticmethod
    def _who(attempt: str, entry: dict[str, Any]) -> str:
        return f"generation {entry.get('generation')}, attempt {attempt} on {entry.get('worker')}"

    @property
    def fence_key(self) -> str | None:
        keys = [e["key"] for _, e in self._entries() if e.get("key")]
        return str(keys[-1]) if keys else None

    @property
    def fence_generation(self) -> int | None:
        entries = [e for _, e in self._entries() if e.get("generation") is not None]
        counted = [e for e in entries if e["verdict"].startswith("completed")]
        if counted:
            return int(counted[-1]["generation"])
        return int(max(e["generation"] for e in entries)) if entries else None

    @property
    def fence_counted(self) -> str | None:
        done = [(a, e) for a, e in self._entries() if e["verdict"].startswith("completed")]
        return self._who(*done[-1]) if done else None

    @property
    def fence_stale(self) -> str | None:
        stale = [
            f"{self._who(a, e)}: {e.get('reason') or 'rejected'}"
            for a, e in self._entries()
            if e["verdict"] == "stale"
        ]
        return "; ".join(stale) or None

    @property
    def fence_attempts(self) -> str | None:
        shown = []
        for attempt, entry in self._entries():
            reason = f" ({entry['reason']})" if entry.get("reason") else ""
            shown.append(f"{self._who(attempt, entry)}: {entry['verdict']}{reason}")
        return "; ".join(shown) or None


def install() -> None:
    """Make Flower's event state keep and show the fence fields (run it in Flower's process:
    its ``--conf`` file). Idempotent; raises a clear error when Flower is not installed."""
    try:
        from flower.events import EventsState
    except ImportError as exc:  # pragma: no cover - flower is an optional extra
        raise ImportError(
            "celery_fence.contrib.flower.install() runs inside Flower: pip install flower "
            "(or celery-fence[flower]) and call it from Flower's config file (--conf)"
        ) from exc
    EventsState.Task = FencedTaskView


__all__ = ["FENCE_FIELDS", "SUBJECT_PREFIX", "FencedTaskView", "install"]
