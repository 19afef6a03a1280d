"""``--experiment``: candidate hot-path changes, measured against the shipped code in one run.

``apply()`` runs only in a second worker started with ``BENCH_EXPERIMENT=1`` (the
``fenced-pg-exp`` variant) and monkeypatches the candidate in; nothing here changes celery-fence
itself. Put the next candidate here, run ``python -m bench --experiment``, and compare
``fenced-pg-exp`` with ``fenced-pg`` in the same rounds.

The candidates measured so far are now part of the shipped code: the renewer thread is woken only
when its plan changes, the two critical-path statements run on a pooled DB-API cursor as
server-side prepared statements, and a claim carries the previous attempts' releases in its own
script call. With no candidate, ``fenced-pg-exp`` measures the shipped code a second time (a
check on the noise between two identical workers).

Measured and not adopted: the transitions table off (``fence_record_transitions=False`` forced in
the second worker) changed nothing measurable — ``python -m bench --experiment --rounds 3``:
fenced-pg median ratio 0.631, the candidate 0.639; PostgreSQL CPU 0.478 vs 0.457 ms a task.

Measured and not adopted: the registration committed with ``SET LOCAL synchronous_commit TO
off`` (sent with its ``EXECUTE`` in one query; the completion's synchronous commit would flush
its WAL record with it). ``python -m bench --experiment --rounds 2``, asynchronous vs
synchronous registration: median ratio 0.628 vs 0.626 (tasks/s by round 375/441 vs 438/390:
noise); in-process with 50 ms bodies the registration got
0.3 ms faster and the completion 0.15-0.3 ms slower (the WAL flush it skipped is paid by the
next one), 54.24 vs 54.21 ms a task. No gain, and a crash window against stale attempts: no.
"""

from __future__ import annotations


def apply() -> None:
    """Monkeypatch the current candidate into this worker (none at the moment)."""
