"""The transition signals a Celery user connects to (which action sends which: the table in
:mod:`celery_fence.announce.transitions`).

Every signal is a Celery :class:`~celery.utils.dispatch.Signal` whose sender is the task, sent
with keyword arguments ``key``, ``attempt_id``, ``generation`` and ``reason`` (plus a few more
where they fit: ``remaining`` for ``lease_busy``, ``countdown`` and ``attempts`` for retries,
``attempts`` for ``job_dead``). Nothing here ever carries args, kwargs, results or outbox payloads.

- ``lease_claimed``: a generation was claimed in Redis (before the store registers it).
- ``lease_renewed`` / ``lease_lost``: sent from the renewal thread (``lease_lost`` also from the
  task's own ``check()``). Their receivers run on the one heartbeat thread of the process: keep
  them fast, or other leases' renewals wait behind them.
- ``lease_busy``: another attempt holds the lease; the message is rescheduled (``generation`` is
  None, ``remaining`` the seconds the holder still has).
- ``job_completed``: after the fenced completion is committed and before the message is acked,
  so a receiver can rely on the result being durable.
- ``job_replayed``: a redelivered message found the job completed and returns the stored result.
- ``stale_rejected``: the store refused this attempt's write; a newer generation owns the job.
- ``job_retry_scheduled``: the message is re-sent after ``countdown`` seconds (retry policy, lost
  lease, store or lease store unavailable, newer generation still running; ``reason`` exactly
  ``group_full`` or ``rate_limited`` when over ``fence_group_limit`` / ``fence_rate_limit``,
  with ``generation`` and ``attempts`` None: the limits are taken before the claim).
- ``job_dead``: the job reached the terminal ``dead`` state.
- ``job_taken_over``: an attempt registered a job that recovery took over from an attempt that
  never ended (its worker froze, died or lost the message), with ``previous_generation`` (the
  generation taken over) and ``seconds`` (from the previous attempt's last move in the store —
  its claim or its last fenced write — to this claim: the time-to-takeover, an upper bound of the
  time the job stood still; measured on wall clocks of two hosts). Sent once per takeover, by the
  new attempt's worker, after its registration and before its body runs.
- ``unfenced_write``: the body committed a write that no fenced block covers (once per attempt;
  ``where`` names the connection, ``table`` the table when known).

``job_retry_scheduled`` is also sent when the CLI requeues a job and when recovery re-sends a
stranded one; ``job_dead`` when recovery buries a stranded job it cannot re-send.

A receiver that raises never breaks the fenced path: Celery's ``send`` catches and logs each
receiver's exception, and :func:`celery_fence.announce.transitions.emit_transition` guards the rest.
That function also logs every transition and sends its Celery event; which action sends which signal
is its table, :data:`celery_fence.announce.transitions.TABLE`.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

_ARGS = {"key", "attempt_id", "generation", "reason"}

lease_claimed = Signal(name="lease_claimed", providing_args=_ARGS)
lease_renewed = Signal(name="lease_renewed", providing_args=_ARGS)
lease_lost = Signal(name="lease_lost", providing_args=_ARGS)
lease_busy = Signal(name="lease_busy", providing_args=_ARGS | {"remaining"})
job_completed = Signal(name="job_completed", providing_args=_ARGS)
job_replayed = Signal(name="job_replayed", providing_args=_ARGS)
stale_rejected = Signal(name="stale_rejected", providing_args=_ARGS)
job_retry_scheduled = Signal(name="job_retry_scheduled", providing_args=_ARGS | {"countdown"})
job_dead = Signal(name="job_dead", providing_args=_ARGS | {"attempts"})
#: A recovered job's new attempt registered: ``previous_generation`` and ``seconds`` besides the
#: usual arguments (see the module docstring).
job_taken_over = Signal(
    name="job_taken_over", providing_args=_ARGS | {"previous_generation", "seconds"}
)
#: Sent inside an open ``fence.atomic()`` block just before its ownership check: the block's
#: writes are made and not committed yet (the testing plugin pauses a worker here).
block_committing = Signal(name="block_committing", providing_args=_ARGS)
#: A fenced body committed a write outside every fenced block (``fence_unfenced_writes`` is
#: ``"warn"`` or ``"error"``): sent once per attempt, with ``where`` (the connection) and
#: ``table`` (the table, or None when not known) besides the usual arguments.
unfenced_write = Signal(name="unfenced_write", providing_args=_ARGS | {"where", "table"})

__all__ = [
    "block_committing",
    "job_completed",
    "job_dead",
    "job_replayed",
    "job_retry_scheduled",
    "job_taken_over",
    "lease_busy",
    "lease_claimed",
    "lease_lost",
    "lease_renewed",
    "stale_rejected",
    "unfenced_write",
]
