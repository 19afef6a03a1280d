"""One periodic tick, any number of beat replicas: ``celery beat -S celery_fence.beat:Scheduler``.

Plain ``celery beat`` must run as exactly one process: two send every tick twice (celery #2856),
and none sends nothing. This scheduler enqueues each tick of each entry
(:func:`celery_fence.durable.enqueue`) as the job of its fence key :func:`tick_key`
``beat:<entry name>:<scheduled time, ISO 8601 UTC, second precision>``: the job's ``pending``
row and the entry's record in ``fence_beat_ticks`` are written in one transaction on the store's
database, and the message is published after that commit (a task whose ``fence_database_url``
names another database: the record is written right after the row's commit; a replica that
dies in between leaves the tick to a later pass, which finds its job). So every replica's copy
of one tick is the same job: a replica that reaches a tick another one enqueued finds its job
(no second row, no second message), and the job completes once (a duplicate message replays
the stored completion, or is re-sent while the key is busy). Run two or three replicas and
lose any of them.

A tick's message lost after the commit (the publish failed, the replica died before it, or a
broker without persistence restarted before a worker took it) leaves its job ``pending``: the
workers' recovery re-sends it once it has not moved for ``fence_recover_pending_after`` seconds
(60 by default), and it runs once. A transaction that fails leaves neither the row nor the
record: the tick is sent on a later pass, under the same key.

Every replica derives a tick's scheduled time from the schedule, never from its own "now":

- ``schedule(run_every=N)`` (a number or a ``timedelta`` in ``beat_schedule``): the multiples of
  ``N`` seconds since the Unix epoch (``N`` at least 1 second);
- ``crontab(...)``: the crontab's own due times.

Any other schedule (``solar``, a custom class) is refused when the scheduler starts, and so is an
entry whose task is not a :class:`~celery_fence.FencedTask` registered in the beat process: a
plain task's copies would each run. Make it ``@app.task(base=FencedTask)`` (its body then runs
once per tick), or keep it under a plain single ``celery beat``. An entry's ``options`` must be
ones ``enqueue()`` keeps with the job and its ``args``/``kwargs`` JSON (a re-send publishes the
tick from its row); anything else is refused at start too. A tick is keyed on the tick alone: a
task's ``fence_key`` and ``fence_unique`` do not apply to its beat ticks. celery-fence's own
maintenance tasks (:data:`MAINTENANCE_TASKS`: ``celery_fence.recover``, ``celery_fence.purge``,
``celery_fence.outbox.sweep``) are plain tasks safe to run concurrently: sent without a key (and
recorded after the send), a tick of theirs runs once per replica that reached it before another
recorded it (1 to N times). Celery's own ``celery.backend_cleanup`` entry (a plain task) is not
installed.

The record in ``fence_beat_ticks`` (a conditional upsert that only moves forward) is each
entry's last fired tick; ``celery fence beat ls`` shows it. Ticks an entry missed while every
replica was down (between its recorded tick and now) follow ``fence_beat_missed``: ``skip`` (the
default) sends only the latest, ``catch_up`` each of them, at most ``fence_beat_catch_up_max``
(the latest ones), each under its own key. An entry with no recorded tick starts with the first
tick after the replica started.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import logging
import math
from typing import Any

import sqlalchemy as sa
from celery import beat
from celery.schedules import crontab, schedstate, schedule
from celery.utils.time import remaining

from celery_fence.actions import LogAction
from celery_fence.adapters.task import FencedTask
from celery_fence.config import FenceConfig
from celery_fence.durable import check_options, enqueue
from celery_fence.errors import ConfigurationError
from celery_fence.ops.outbox import SWEEP_TASK
from celery_fence.ops.recovery import RECOVER_TASK
from celery_fence.ops.retention import PURGE_TASK
from celery_fence.pipeline.backends import store_for
from celery_fence.schema import as_utc, utcnow
from celery_fence.store import Store
from celery_fence.store.beat import TICK_PREFIX, tick_key
from celery_fence.store.urls import different_database

logger = logging.getLogger("celery_fence.beat")

#: The shortest interval a ``schedule(run_every=...)`` entry may have: a tick's key has second
#: precision.
MIN_INTERVAL = 1.0
#: Due times of a crontab entry looked at, at most, to find its missed ticks (a minute crontab
#: down for ~70 days); beyond, the oldest are not looked at.
MAX_CRONTAB_STEPS = 100_000
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
#: celery-fence's own maintenance tasks (plain tasks, each safe to run concurrently and again):
#: sent without a key, so a tick of theirs may run once per replica.
MAINTENANCE_TASKS = frozenset({RECOVER_TASK, PURGE_TASK, SWEEP_TASK})


def next_tick(timing: Any, after: dt.datetime) -> dt.datetime:
    """The first scheduled time of ``timing`` (an entry's ``schedule``) strictly after
    ``after``, UTC: a multiple of the interval since the epoch, or the crontab's next due
    time."""
    after = as_utc(after)
    if isinstance(timing, crontab):
        last, delta, _ = timing.remaining_delta(after)
        return as_utc(last + remaining(last, delta, now=last))
    period = _interval(timing)
    since = (after - _EPOCH).total_seconds()
    return _EPOCH + dt.timedelta(seconds=(math.floor(since / period) + 1) * period)


def due_ticks(
    timing: Any, after: dt.datetime, now: dt.datetime, *, missed: str, catch_up_max: int
) -> list[dt.datetime]:
    """The ticks to send now, oldest first: those scheduled in ``(after, now]``, by the
    missed-tick policy — ``skip``: the latest only; ``catch_up``: the latest ``catch_up_max``."""
    keep = 1 if missed == "skip" else catch_up_max
    after, now = as_utc(after), as_utc(now)
    if not isinstance(timing, crontab):
        period = _interval(timing)
        first = next_tick(timing, after)
        if first > now:
            return []
        latest = _EPOCH + dt.timedelta(
            seconds=math.floor((now - _EPOCH).total_seconds() / period) * period
        )
        count = min(keep, round((latest - first).total_seconds() / period) + 1)
        return [latest - dt.timedelta(seconds=period * i) for i in reversed(range(count))]
    ticks: collections.deque[dt.datetime] = collections.deque(maxlen=keep)
    at = after
    for _ in range(MAX_CRONTAB_STEPS):
        at = next_tick(timing, at)
        if at > now:
            break
        ticks.append(at)
    return list(ticks)


def _interval(timing: Any) -> float:
    period = timing.run_every.total_seconds()
    return float(period)


class Scheduler(beat.Scheduler):
    """``celery beat -S celery_fence.beat:Scheduler``: each tick sent under its fence key, so any
    number of replicas send each tick's job once (see the module docstring).

    ``clock`` (keyword) is the current time as an aware UTC datetime (tests pass their own).
    """

    def __init__(self, app: Any, *args: Any, clock: Any = None, **kwargs: Any) -> None:
        self._clock = clock or utcnow
        self._started = as_utc(self._clock())
        #: The latest tick this replica knows was sent, per entry (its own or a recorded one).
        self._fired: dict[str, dt.datetime] = {}
        self._config: FenceConfig | None = None
        super().__init__(app, *args, **kwargs)

    # -- the schedule ------------------------------------------------------------------------

    def install_default_entries(self, data: Any) -> None:
        """No ``celery.backend_cleanup``: a plain task, which several replicas would each send.
        Schedule a fenced task of your own to clean a result backend up."""

    def setup_schedule(self) -> None:
        super().setup_schedule()
        for entry in self.schedule.values():
            self.check(entry)
        self._check_table()

    def _check_table(self) -> None:
        """Refuse to start on a store without ``fence_beat_ticks`` (a database not upgraded); an
        unreachable one is only logged: beat waits it out, entry by entry."""
        try:
            present = self.store().beat_ticks.table_exists()
        except Exception as exc:
            logger.warning(
                "fence beat: the store could not be checked (%s); ticks wait for it",
                type(exc).__name__,
                extra={"action": LogAction.BEAT_SEND_FAILED},
            )
            return
        if not present:
            raise ConfigurationError(
                "the fence store's database has no fence_beat_ticks table (celery-fence 0.4 "
                f"adds it): run 'celery -A {self.app.main or '<app>'} fence init-db' (or "
                "manage.py migrate with Django), then start beat again"
            )

    def check(self, entry: Any) -> None:
        """Refuse ``entry`` (:class:`ConfigurationError`) unless its task is a fenced task this
        process knows and its schedule is an interval of at least a second or a crontab."""
        task = self.app.tasks.get(entry.task)
        if entry.task in MAINTENANCE_TASKS:
            task = FencedTask  # sent by name, without a key (see MAINTENANCE_TASKS)
        if task is None:
            raise ConfigurationError(
                f"beat entry {entry.name!r}: task {entry.task!r} is not registered in the beat "
                "process, so celery_fence.beat.Scheduler cannot tell that it is fenced; import "
                "its module in the app (include=[...] or imports=[...])"
            )
        if not (task is FencedTask or isinstance(task, FencedTask)):
            raise ConfigurationError(
                f"beat entry {entry.name!r}: task {entry.task!r} is not a FencedTask, so every "
                "beat replica's copy of a tick would run; declare it with "
                "@app.task(base=FencedTask) (its ticks then run once each), or run it from a "
                "plain, single celery beat"
            )
        if task is not FencedTask:
            self._check_enqueueable(entry, task)
        timing = entry.schedule
        if isinstance(timing, crontab):
            return
        if type(timing) is not schedule:
            raise ConfigurationError(
                f"beat entry {entry.name!r}: celery_fence.beat.Scheduler takes an interval "
                "(a number of seconds, a timedelta or schedule(run_every=...)) or a crontab, not "
                f"{type(timing).__name__}: every replica must compute the same scheduled times"
            )
        if _interval(timing) < MIN_INTERVAL:
            raise ConfigurationError(
                f"beat entry {entry.name!r}: an interval of {_interval(timing):g}s; "
                f"celery_fence.beat.Scheduler needs at least {MIN_INTERVAL:g}s (a tick's key "
                "has second precision)"
            )

    @staticmethod
    def _check_enqueueable(entry: Any, task: Any) -> None:
        """Each tick is a job enqueued with its request and options stored (a lost message is
        re-sent from them): its options must be ones enqueue() keeps, its arguments JSON."""
        try:
            check_options(task, entry.options)
        except ConfigurationError as exc:
            raise ConfigurationError(f"beat entry {entry.name!r}: {exc}") from None
        values = [*entry.args, *entry.kwargs.values()]
        if any(isinstance(v, beat.BeatLazyFunc) for v in values):
            return  # evaluated at each tick; enqueue() refuses a value that is not JSON
        try:
            json.dumps(values, allow_nan=False)
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"beat entry {entry.name!r}: its args or kwargs are not JSON, so its ticks "
                "cannot be stored to be re-sent; pass plain dicts, lists, str, int, float, bool "
                "or None"
            ) from None

    # -- when an entry is due -----------------------------------------------------------------

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        """Celery's heap, with each entry's first check at its next scheduled time."""
        self._heap = []
        for entry in self.schedule.values():
            is_due, delay = self.is_due(entry)
            self._heap.append(beat.event_t(self._when(entry, 0 if is_due else delay), 5, entry))
        beat.heapq.heapify(self._heap)

    def is_due(self, entry: Any) -> schedstate:
        """Due when a scheduled time passed since the latest tick this replica knows was sent;
        the next check is at the next scheduled time."""
        now = as_utc(self._clock())
        upcoming = next_tick(entry.schedule, self._known(entry.name))
        following = next_tick(entry.schedule, now)
        if upcoming <= now:
            return schedstate(True, (following - now).total_seconds())
        return schedstate(False, (upcoming - now).total_seconds())

    def _known(self, name: str) -> dt.datetime:
        fired = self._fired.get(name)
        return self._started if fired is None else max(fired, self._started)

    # -- sending ------------------------------------------------------------------------------

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Send ``entry``'s due ticks (by the missed-tick policy) that no replica recorded yet,
        each under its key, and record each after its send. A failure is logged; the tick is
        sent on a later pass (by this replica or another)."""
        try:
            self._send_due(entry, producer)
        except Exception as exc:  # beat goes on: the next pass sends what this one did not
            logger.error(  # the error's type only: a message may quote the entry's arguments
                "fence beat: entry %s not sent or not recorded (%s); retried on its next check",
                entry.name,
                type(exc).__name__,
                extra={"action": LogAction.BEAT_SEND_FAILED, "fence_beat_entry": entry.name},
            )

    def _send_due(self, entry: Any, producer: Any) -> None:
        config = self.fence_config()
        recorded = self.store().beat_ticks.last(entry.name)
        after = self._started if recorded is None else recorded  # missed ones: by the policy
        ticks = due_ticks(
            entry.schedule,
            after,
            self._clock(),
            missed=config.beat_missed,
            catch_up_max=config.beat_catch_up_max,
        )
        fired = self._fired.get(entry.name)
        if recorded is not None and (fired is None or recorded > fired):
            self._fired[entry.name] = recorded
        for scheduled in ticks:
            self.send_tick(entry, scheduled, producer)
            self._fired[entry.name] = scheduled

    def send_tick(self, entry: Any, scheduled: dt.datetime, producer: Any = None) -> Any:
        """Send ``entry``'s tick scheduled at ``scheduled`` and record it in
        ``fence_beat_ticks``: a fenced task's through :func:`~celery_fence.durable.enqueue`
        under its :func:`tick_key`, the job's ``pending`` row and the record in one transaction
        (a task whose store is another database: the record right after the row's commit) and
        the message after its commit (the :class:`~celery_fence.durable.Enqueued`); a
        maintenance task's sent without a key, then recorded (its ``AsyncResult``)."""
        self.check(entry)
        options = dict(entry.options)
        headers = dict(options.pop("headers", None) or {})
        headers["celery_beat_task"] = True
        args = beat._evaluate_entry_args(entry.args)
        kwargs = beat._evaluate_entry_kwargs(entry.kwargs)
        ticks_store = self.store()
        ticks = ticks_store.beat_ticks
        if entry.task in MAINTENANCE_TASKS:  # not fenced: each replica's copy runs
            result = self.app.send_task(
                entry.task, args, kwargs, producer=producer, headers=headers, **options
            )
            ticks.advance(entry.name, scheduled)
            return result
        key = tick_key(entry.name, scheduled)
        task = self.app.tasks[entry.task]
        jobs = task.fence_backends().store  # the task's own store (fence_database_url) ...
        apart = different_database(sa.make_url(ticks_store.url), sa.make_url(jobs.url))
        with jobs.beat_ticks.transaction() as conn:
            job = enqueue(
                conn,
                task,
                args,
                kwargs,
                key=key,
                unique=False,
                producer=producer,
                headers=headers,
                **options,
            )
            if apart is None:  # ... is beat's: the row and the record commit together
                ticks.advance(entry.name, scheduled, conn=conn)
        if apart is not None:  # recorded after the row's commit (a failure: sent again)
            ticks.advance(entry.name, scheduled)
        logger.info(
            "fence beat: %s %s (%s)",
            "enqueued" if job.created else "found already enqueued",
            key,
            entry.task,
            extra={"action": LogAction.BEAT_SENT, "fence_key": key},
        )
        return job

    # -- settings and the store ---------------------------------------------------------------

    def fence_config(self) -> FenceConfig:
        if self._config is None:
            self._config = FenceConfig.from_app(self.app)
        return self._config

    def store(self) -> Store:
        return store_for(self.fence_config())

    @property
    def info(self) -> str:
        config = self.fence_config()
        return (
            f"    . fenced ticks: missed={config.beat_missed}, "
            f"catch_up_max={config.beat_catch_up_max}"
        )


__all__ = [
    "MAINTENANCE_TASKS",
    "MIN_INTERVAL",
    "TICK_PREFIX",
    "Scheduler",
    "due_ticks",
    "next_tick",
    "tick_key",
]
