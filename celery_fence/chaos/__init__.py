"""The chaos suite: every failure window, injected into real workers, then checked.

Run it against your own configuration (your Redis, broker, database and TTLs)::

    python -m celery_fence.chaos [--scenario NAME|all ...] [--runs N] [--seed S]
        [--redis-url URL] [--broker-url URL] [--database-url URL] [--pg-admin-url URL]
        [--ttl SECONDS] [--max-attempts N] [--workers N] [--own-redis] [--unfenced] [--unsettled]
        [--rerun-finished] [--async-endings] [--unfenced-steps] [--rows N]
        [--provider-not-idempotent] [--ttl-lock] [--stock-beat] [--no-group-limit]
        [--celery-rate-limit] [--duration SECONDS]
        [--converge-timeout SECONDS] [--json PATH] [--workdir DIR] [-q]

Defaults: Redis ``redis://127.0.0.1:6379/1`` (leases under a fresh key prefix, the ledger,
results), broker ``redis://127.0.0.1:6379/2`` (a fresh queue), a fresh SQLite file per scenario,
``--ttl 1.5`` (renewal every ttl/3), ``--max-attempts 3``, ``--runs 3``, ``--seed 0``, two
workers per scenario. ``--scenario`` is repeatable or comma-separated. Exit status: 0 when every
safety column is zero, 1 when one is not, 2 when a harness step itself failed (e.g. a job never
started; the runs so far, and the aborted run's jobs, are still checked and reported) or a
scenario was skipped (not run), 130 on Ctrl-C. ``--json PATH`` writes
the same results (and the table) as JSON.

Each scenario starts its own real workers (``celery -A celery_fence.chaos.workload worker -c 1``,
each in its own process group) on a fresh queue, key prefix and database, runs ``--runs`` times
with timings drawn from ``random.Random(seed)``, then the checker reads the history. Every
process the harness starts is killed by process group on success, failure, Ctrl-C, SIGTERM and
exit (the harness's process module, :mod:`celery_fence.testing.processes`, which the pytest
plugin and the project's tests share). The workload (:mod:`celery_fence.chaos.workload`)
writes a ledger of body starts, side effects (with generation and attempt id), external calls and
kills; every completed job stages one ``notify`` outbox effect delivered to a
:class:`~celery_fence.testing.ProviderStub` that dedupes on ``Idempotency-Key``.

Scenarios (faults counted per run, from what happened: the ledger, the store, the broker):

- ``pause``: SIGSTOP the worker running the job mid-body for 1.2-1.6 TTL (its lease expires), send
  the job again so a second worker takes over with a newer generation, SIGCONT the first one:
  even runs while the newer attempt still runs (its body outlasts the first one's, so the stale
  completion meets a newer row still ``running``), odd runs after it completed. Runs cycle
  through four bodies: with or without ``guard()`` before the side effect, with or without an
  outbox effect; run 0 has neither, so the store's generation fence alone must reject the stale
  attempt. Expected: attempts 2, body starts 2. Faults: 1 when the paused attempt learnt it had
  lost its lease (ledger ``lost``) or reached the store after the newer attempt started.
- ``kill``: three jobs at once, one per window, each with a one-shot flag the body takes (GET
  and DEL at once) right before ``os.kill(os.getpid(), SIGKILL)``: before the side effect, after
  it but before the completion commit, after the commit but before the ack (a ``job_completed``
  receiver). Faults: the kills that happened (3).
- ``duplicate``: the same logical job sent 4 times at once to the workers. Faults: the copies
  that met another copy's lease or completion (ledger ``busy``, ``replayed`` or ``stale`` of
  their task id; 3 when every copy but one did).
- ``redis-loss``: mid-body, every lease and generation counter of the run is deleted (with
  ``--own-redis``: the harness's own redis-server is SIGKILLed and restarted, empty), then the job
  is sent again, so Redis hands out a generation the store already saw. Faults: the claims
  that got a generation the store had already seen: the fence's regression branch taken (ledger
  ``regressed``: the counter raised above the store's, the claim made again) or, where nothing
  took it (``--unfenced``), a body started with a generation no greater than an earlier one's.
- ``db-outage``: PostgreSQL only — a TCP proxy the harness runs on a free loopback port in front of
  ``--database-url`` (or of a throwaway database it creates through ``--pg-admin-url`` when the
  store is SQLite; skipped, with the reason, when there is none) resets every open connection and
  every new one for 0.5-2 s while two bodies finish and complete, then forwards again. The
  workers talk to the proxy, the checker to the database directly. Faults: the store
  connections the workers attempted inside the outage.
- ``unknown-remote``: the body charges the provider with ``Idempotency-Key`` =
  ``idempotency_key(key, "charge")``; the provider performs the first request, then answers after
  3x the client's timeout, so the call times out; the retry sends the same key and gets the stored
  response. Faults: the timeouts (1).
- ``app-write``: the body writes one row to the app's own table (``chaos_app_rows``) inside
  ``self.fence.transaction()``; the worker is SIGSTOPped inside the block, after it entered and
  before its write, for 1.2-1.6 TTL; a second worker takes the job over and writes its own row;
  the first one gets SIGCONT (on SQLite, where the paused block holds the write lock, as soon as
  the newer attempt has started or two TTLs have passed). Faults: as ``pause``'s, for the
  attempt paused (or held) in its block.
- ``orm-binds``: ``app-write``'s windows with the row written through ``self.fence.session()``
  of an ORM session whose ``binds=`` route the app's table to an engine of its own (as
  Flask-SQLAlchemy's session does): the fenced session must run that write on the block's
  connection, whose commit is checked. Faults: as ``app-write``'s.
- ``django-write``: ``app-write``'s windows with the row written by Django's ORM inside
  ``self.fence.atomic()`` (a Django configured in the worker for the store's database): the
  ownership check runs on Django's own connection before its commit. Faults: as
  ``app-write``'s.
- ``beside-block``: PostgreSQL only. ``app-write``'s pause inside the ``fence.transaction()``
  block; after the pause each attempt writes on another connection of the store's database
  (committed there), run ``i`` in the text form ``BESIDE_FORMS[i % 6]``: ``/* audit */
  UPDATE``, ``WITH d AS (UPDATE\n...)``, a writing function in a ``SELECT``, ``CALL`` of a
  procedure, a ``DO`` block, ``SELECT ... INTO`` (ledger ``beside_refused``, or
  ``beside_committed`` with ``t0`` just before its COMMIT). Faults: as ``app-write``'s. Control
  arm: ``--unwatched``.
- ``atomic-threads``: PostgreSQL only. Two threads of one attempt each write a row in a
  ``self.fence.atomic()`` block of its own (the second opens once the first is inside); the
  worker is SIGSTOPped inside both past its TTL while a newer attempt takes over. Faults: as
  ``app-write``'s. Control arm: ``--unfenced``.
- ``interrupted``: a body ends with ``asyncio.CancelledError`` (an exit that is not an
  ``Exception``) on a threads-pool worker (even runs) or a gevent-pool worker (odd runs); the
  attempt must settle and release its lease, and the job completes on its second attempt. Under
  ``--unsettled`` the exit escapes with its lease held: the job is lost. Faults: the
  interruptions raised (ledger ``interrupt``).
- ``poison``: a job whose input always fails permanently (``PermanentError``: dead after one
  attempt) and a job that SIGKILLs its worker every time (dead after ``fence_max_attempts`` body
  runs). Faults: the permanent errors raised + the kills (ledger ``permanent``, ``kill``).
- ``time-limit``: two jobs sent with a hard ``time_limit`` of 1-1.5 s (the prefork pool kills the
  process running the body): one overruns on its first run only (a one-shot flag) and must end
  ``completed`` on its second execution (attempts 2, body starts 2); one overruns on every run
  and must end ``dead`` with reason "time limit" after ``fence_max_attempts`` executions
  (attempts and body starts both ``fence_max_attempts``). Faults: the overruns.
- ``expires``: two jobs sent with ``expires=1.5``: one whose first run fails with a transient
  error after 1.7-2.1 s (its retry is sent after the expiry and must arrive), one that meets a
  lease the harness holds under a foreign token for 1.8-2.3 s, as a slow or paused worker would
  (its busy reschedule arrives after the expiry and must run). Both must complete (attempts and
  body starts: 2 and 1). Faults: a delivery that met the held lease (ledger ``busy``) + the
  failures that came after the expiry (2).
- ``misconfig``: no worker runs; three jobs are queued, then a worker starts with
  ``fence_renew_interval`` = 0.95-1.2 x ttl (at least ttl x (1 - ``fence_lease_margin``)): it must
  refuse to start and leave the three messages in the broker; then a correctly configured worker
  starts and must complete each (attempts 1, body starts 1). A misconfigured worker that started,
  or took a message, is an unexpected outcome for each job. Faults: 1 when the misconfigured
  worker met the setting (its log names ``fence_renew_interval``: refused at start, or, under
  ``--unsettled``, at a task).
- ``refused-arg``: PostgreSQL only (``--database-url`` when it is PostgreSQL, else a throwaway
  database through ``--pg-admin-url``, as for db-outage; skipped with the reason when there is
  none — SQLite stores the NUL character): a job whose argument holds ``"\\u0000"``, which jsonb
  refuses, must end ``dead`` at once with reason "arguments refused by the database": attempts 1,
  the body never run, one generation claimed in Redis (no loop), and its stored request must
  decode to the arguments sent (``fence show`` / ``fence requeue``). Faults: the generations
  claimed for it (each a registration the database was asked to take: 1, or a loop).
- ``recovered-chain``: a chain ``a | b`` (``b`` immutable) whose first step's message is lost: the
  worker running ``a`` (one worker runs at a time) is SIGKILLed mid-body, main process and pool,
  and what the broker still holds for the queue is dropped (the Redis transport's unacked entry;
  on RabbitMQ the message that came back, purged). Once ``a``'s lease is gone, the harness sends
  ``celery_fence.recover`` (as beat would) to a fresh worker: ``a`` is re-sent with its stored
  workflow and must complete once (attempts 2, body starts 2), and ``b`` must then run and
  complete (attempts 1, body starts 1). Faults: the messages dropped from the broker.
- ``enqueue-crash``: a child process (the app's side) writes 3 orders and enqueues their jobs
  with :func:`celery_fence.enqueue` in one transaction, and is SIGKILLed between its commit and
  its publish; then a worker starts and ``celery_fence.recover`` is sent (as beat would, with
  ``older_than`` one TTL): each job must complete once (attempts 1, body starts 1). 1 fault.
- ``broker-loss``: the child enqueues 100 jobs and publishes them; the broker's queue is
  deleted before any worker runs; then a worker starts and ``celery_fence.recover`` is sent:
  all 100 must complete once. Faults: the messages deleted.
- ``store-crash``: the store on a PostgreSQL cluster the harness starts itself (``initdb`` in a
  temporary directory, a free port; run as the ``postgres`` OS user when the harness is root;
  skipped, with the reason, without PostgreSQL's server binaries) and crashes with ``pg_ctl stop
  -m immediate``, twice a run: once while a worker (``-c 4``) holds four jobs at four points —
  after its block committed, between its completion's commit and its ack, registered with its
  body asleep, inside its block with its row written — and once while ``celery_fence.recover``
  re-sends three jobs enqueued and never published; then starts it again. Every job must complete
  once (the after-commit one: attempts 1, body starts 1). What each crash did to each job's row is
  printed. Faults: the crashes (2). :mod:`.scenarios_crash`.
- ``steps``: a job of three fenced steps (``self.fence.run_step()``; each an unguarded external
  call, ledger ``effect``, and an app-table row in the step's transaction); the worker is
  SIGSTOPped inside step ``k`` (1 on odd runs, 2 on even ones) past its TTL, the job is sent again,
  a newer attempt takes it over, and the first one gets SIGCONT. Expected: attempts 2, body starts
  2; no step body started after another attempt committed that step (an unexpected outcome), no
  step started by the paused attempt after the newer registration (a stale effect). Control arm:
  ``--unfenced-steps``. Faults: as ``pause``'s. :mod:`.scenarios_steps`.
- ``export``: a checkpointed export of ``--rows`` rows (default 10,000; ``--rows 1000000``
  works) in 20 batches, each batch's rows and its ``self.fence.checkpoint()`` in one fenced block;
  the pool process running it is SIGKILLed at a random batch (up to twice a run, fewer than
  ``--max-attempts``) and the message comes back. Expected: every row exported exactly once, and
  at most one batch (one checkpoint interval) of work repeated per kill (printed). Control arm:
  ``--unfenced-steps`` (no checkpoint: every attempt starts from zero). Faults: the kills.
- ``unique``: one uniqueness key a run, three waves of sends of a unique task
  (``fence_unique``) from the app's side; the first wave's job (its holder) hangs and dies — even
  runs SIGKILL its whole worker (recovery is sent every TTL, as beat would), odd runs kill it by a
  hard time limit — then the second wave is sent, and once the job completed, the third. Every
  wave must be followed by a run of the key (a wave with none: a lost job), the job must run
  again within ``2 x TTL + 10 s`` of the death and complete once, and two jobs of the key must
  never be unfinished at once. Expected: the holder starts twice, the third wave's job once.
  Control arm: ``--ttl-lock``. 1 fault a run. :mod:`.scenarios_unique`.
- ``beat``: three ``celery beat -S celery_fence.beat:Scheduler`` replicas of a 1-second entry
  (``fence_beat_missed="catch_up"``) and a worker, on a lease ``redis-server`` the scenario starts
  itself; one replica is SIGKILLed as a tick's body starts, the lease Redis is SIGKILLed and
  restarted empty 1-2 s later, the ticks go on 4 s. Every scheduled second between the first and
  the last tick that ran must have its tick's job, completed once (a missing one: a lost job).
  Control arm: ``--stock-beat``. 2 faults a run. :mod:`.scenarios_beat`.
- ``group``: 8 worker processes (two workers ``-c 4``), 24 jobs of one group with
  ``fence_group_limit=3``, two SIGKILLs of processes holding a slot; sampled (the running set
  every 20 ms) and from the ledger's body spans: never more than 3 at once, each killed holder's
  slot free within one TTL of its kill, every job completed once. Control arm
  ``--no-group-limit``. Faults: the kills. :mod:`.scenarios_limits`.
- ``rate``: three workers sharing ``fence_rate_limit="2/s"``, more jobs queued than the window
  takes, a running process SIGKILLed mid-window: the body starts over ``--duration`` seconds
  (default 60) within 10 % of the target. Control arm ``--celery-rate-limit`` (Celery's own
  per-worker ``rate_limit``: 3 workers, about 3 times the rate). Faults: the kill.

Columns (per scenario, summed over its runs). The transitions table is written in the same
statement or transaction as the state change it records, so its ``id`` order for a key is the
order in which the store accepted the writes; ledger times and transition times come from the
same machine's clock.

The **ledger is the witness**: each attempt records, from its own worker, its own generation and
attempt id when its body starts (the store registered it just before), what it wrote, and what
the store answered it (``outcome``: completed, stale, replayed, retry_scheduled, dead). The
checker compares the store's history with that ledger, so a fence that stamps the wrong
generation on its own transition rows is still caught by what the attempts were told.

A scenario that could not run (skipped) or a run the harness aborted is never read as zeros: the
aborted run's jobs are checked as they are (unfinished ones are lost), the scenario is not
"safe", and the summary says what was not run (exit status 2).

- **runs**, **faults injected**: as above.
- **stale attempts refused**: ledger ``outcome`` entries ``stale``: attempts that reached the
  store with their write and were refused (what happened, not what was planned).
- **stale writes accepted** (safety): (w) the witness: an attempt of generation g that the store
  told its ``completed`` or ``dead`` write was accepted, for a key where an attempt of a generation
  g' > g registered and started its body before that answer was recorded (a terminal write refuses
  every later registration, so the newer one came first); (a) fenced store writes — transitions
  ``claimed``, ``completed``, ``retry_scheduled``, ``dead`` — from generation g recorded after a
  ``claimed`` transition of a generation g' > g for the same key; (b) fenced store writes recorded
  after the key's first ``completed`` or ``dead`` transition (a terminal state overwritten: only an
  attempt that lost its ownership can write then); (c) ledger side effects of generation g whose
  ``guard()`` was entered after a generation g' > g had been registered (the ``claimed``
  transition's time precedes the effect's ``t0``). A write found by more than one of these counts
  once (named by its attempt and action); one write can still break two rules of different columns
  (a stale completion accepted after the newer one is also a duplicate completion).
- **stale app-table writes accepted** (safety): rows of ``chaos_app_rows`` (written through
  ``fence.transaction()``, each with the time just before its INSERT) of generation g written
  after a ``claimed`` transition of a generation g' > g for the same key: the row's commit came
  later still, so it landed although a newer attempt owned the key; and, from the witness, a
  block of generation g that committed (ledger ``tx_committed``) although its commit began after
  an attempt of g' > g had started.
- **generation claimed twice** (safety): one generation registered for two attempts of a key: two
  body starts with the same generation and different attempt ids in the ledger, or two
  ``claimed`` transitions of one generation.
- **lost jobs** (safety): jobs that, within ``--converge-timeout`` of the fault, did not reach
  ``completed`` or ``dead`` in the store, or had a message that never finished (SUCCESS or
  FAILURE), or whose committed outbox effect was never delivered.
- **duplicate completions** (safety): accepted ``completed`` transitions of a key beyond the first,
  or attempts the store told "completed" beyond the first (whichever is more).
- **duplicate external effects** (safety): for each key and effect name (``charge``, ``notify``),
  what the provider performed beyond once, summed over every idempotency key the ledger and the
  outbox used for it; plus outbox rows beyond one per key and effect name.
- **body re-runs after completion** (safety): ledger body starts of a key later than its first
  accepted ``completed`` transition.
- **unexpected outcomes** (safety): a job whose terminal state is not the scenario's expectation:
  no transition rows at all (the checker would have no evidence); a completed job whose stored
  attempt is not the one the store told "completed", or never started a body, or that no
  attempt was told completed; a caller (a SUCCESS message) whose result is not the stored one;
  wrong status (``poison`` jobs, ``time-limit``'s always-overrunning job and ``refused-arg``'s
  must be ``dead``, all others ``completed``); attempts, body starts, the terminal transition's
  reason or the generations claimed other than the scenario states above (``poison``'s
  permanent job: 1 attempt, 1 start; its killer: ``fence_max_attempts`` starts); an after-commit
  kill whose body ran more than once; a stored result not written by the stored generation; a
  message that ended FAILURE although its job completed; an ``unknown-remote`` charge not
  performed exactly once or never retried through its key; what the harness saw go wrong around
  a job (``misconfig``: the misconfigured worker started or took a message; ``refused-arg``: the
  stored request does not decode to the arguments sent).
- **limits broken** (safety; :mod:`.checker_limits`): ``group``: runs in which more attempts of
  the group ran at once than its limit (the ledger's spans, a killed attempt's ending at its
  kill, or the samples), plus kills whose slot was free later than one TTL (+0.25 s of polling)
  after the SIGKILL; ``rate``: runs whose rate over ``--duration`` is off its target by more than
  10 %. What was measured (the most at once, each slot's way back, the rate) is printed and in
  the JSON's ``measured``.
- **max time to converge**: the longest time, over the runs, from the fault (the SIGSTOP, the
  flush, the outage; for the others the send) until every job of the run was terminal, every
  message finished and every effect delivered.

``--unfenced`` is a demonstration, never a setting for production: the workload's task takes the
base :class:`~celery_fence.chaos.arms.UnfencedTask`, whose store has no generation fence
(:class:`~celery_fence.chaos.arms.UnfencedStore`: last writer wins); leases, renewal and
``guard()`` stay on, and ``fence.transaction()`` becomes what it replaces: ``guard()`` on entry,
then a plain transaction. ``--scenario pause --unfenced`` then shows stale writes accepted > 0 (and
usually duplicate completions and re-runs), and ``--scenario app-write --unfenced`` stale app-table
writes > 0, which is the proof that the fence is what keeps the other tables at zero.

``--rerun-finished`` is a demonstration too: the workload's task registers through a store
double (:class:`~celery_fence.chaos.workload.RerunsFinished`, in this package, not in the
fence's own code path) whose registration drops its ``status NOT IN (completed, dead)`` term, so
a newer generation takes a completed or dead job's row again. ``--scenario kill --rerun-finished``
then shows body re-runs after completion > 0 (the message redelivered after the completion
committed runs the body again).

``--async-endings`` is a demonstration too: the workload's task's store
(:class:`~celery_fence.chaos.arms.AsyncEndingsStore`) commits a job's endings as it commits a
registration, without waiting for their WAL flush. ``--scenario store-crash --async-endings``
then shows a lost job: the completion acked before the crash is rolled back by it, with its
registration, and nothing is left to find it.

``--unfenced-steps`` is a demonstration too: the workload's task's fence
(:class:`~celery_fence.chaos.arms.PlainStepsFence`) runs ``run_step()`` as a plain call, nothing
stored and nothing checked at a step's start. ``--scenario steps --unfenced-steps`` then shows
stale writes accepted > 0 (the resumed attempt starts its next step, and its external call, after
the newer attempt registered) and unexpected outcomes > 0 (a step committed by one attempt run
again by the other).

``--no-group-limit`` and ``--celery-rate-limit`` are demonstrations too, made of settings (no
fence code is changed): the group's task keeps ``fence_group`` but has no ``fence_group_limit``
(only Celery's per-worker concurrency: 8 processes run 8 at once), and the rate's task has
Celery's own ``rate_limit="2/s"`` instead of ``fence_rate_limit`` (each worker applies it on
its own). ``--scenario group --no-group-limit`` and ``--scenario rate --celery-rate-limit``
then show limits broken > 0, and the measured figures say by how much.

``--provider-not-idempotent`` is a demonstration too: the provider stub ignores
``Idempotency-Key`` and performs every request, as a provider without idempotency support would.
``--scenario unknown-remote --provider-not-idempotent`` then shows duplicate external effects > 0
(the retried charge is performed twice).

``--ttl-lock`` is a demonstration too: the ``unique`` scenario's task is guarded by a
celery-once-style Redis lock (:class:`~celery_fence.chaos.arms.TTLLockTask`: ``SET NX EX 60``
before each send, deleted when the body returns) instead of the store's unique index, and the
harness sends no recovery (celery-once has no job to re-send). ``--scenario unique --ttl-lock``
then shows lost jobs > 0: the SIGKILLed holder never runs again and its stranded lock discards
the second and third waves (the violation names the lock's remaining TTL).

``--stock-beat`` is a demonstration too: the ``beat`` scenario's replicas run Celery's stock
``PersistentScheduler``. Each sends every tick, each copy a job of its own; the ticks whose
bodies started in the same second are counted as one tick's copies, and ``--scenario beat
--stock-beat`` shows duplicate completions > 0 (about two a second with two replicas left).

``--unsettled`` is a demonstration too: the workload's task takes the base
:class:`~celery_fence.chaos.arms.UnsettledTask`, which leaves Celery's own exits as plain Celery
handles them — a hard time limit is acked, ``expires``
is copied onto the fence's re-sends, the settings are not checked when the worker starts (the
bad setting fails at the first task, acked as FAILURE), and a request the database refuses is
re-sent in a loop. ``--scenario time-limit,expires,misconfig,refused-arg --unsettled`` then shows
lost jobs > 0 in each (rows left ``running`` or ``retrying`` with no message, jobs with no row),
which is the proof that the settle step is what keeps those rows at zero. In ``recovered-chain``
the harness then re-sends the stranded step itself as a bare message (task, args, kwargs and
key: what a re-send kept before the workflow was stored): ``a`` completes, ``b`` never runs, one
lost job a run. In ``enqueue-crash`` and ``broker-loss`` the child uses plain Celery's pattern
instead, ``.delay()`` after the commit: the crashed child's 3 jobs and the deleted queue's 100 are
recorded nowhere, and recovery finds nothing to send (lost jobs 3 and 100 a run). A lost job is
only known lost when ``--converge-timeout`` runs out: compare the arm with the settled run of the
same scenarios, seed and ``--converge-timeout`` (which loses nothing), so the timeout is not
what loses the jobs.

The code, one concept a module: :mod:`~celery_fence.chaos.options` (the scenario names and a
run's options), :mod:`~celery_fence.chaos.scenario` (one scenario's workers, queue, database and
ledger), :mod:`~celery_fence.chaos.scenarios` (the fault injections),
:mod:`~celery_fence.chaos.runner` (a database per scenario, the runs, the checker),
:mod:`~celery_fence.chaos.checker` (the columns), :mod:`~celery_fence.chaos.command` (the command
line and the report) and :mod:`~celery_fence.chaos.workload` (the workers' app). Workers, servers,
fault flags and the database proxy are the test harness's (:mod:`celery_fence.testing`).
"""

from __future__ import annotations

import sqlalchemy as sa

#: The one fenced task of the workload.
TASK_NAME = "celery_fence.chaos.op"
#: The unique and beat scenarios' tasks (:mod:`celery_fence.chaos.workload_unique`).
UNIQUE_TASK = "celery_fence.chaos.unique"
TICK_TASK = "celery_fence.chaos.tick"
#: The effect every completed job stages in the outbox (delivered to the provider).
NOTIFY = "notify"
#: The effect the ``remote`` body calls the provider for directly (with an idempotency key).
CHARGE = "charge"

#: The app's own table the ``app-write`` bodies write through ``self.fence.transaction()``.
app_metadata = sa.MetaData()
APP_ROWS = sa.Table(
    "chaos_app_rows",
    app_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False, index=True),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("attempt_id", sa.String(64), nullable=False),
    sa.Column("written_at", sa.Float, nullable=False),  # epoch seconds, just before the INSERT
)

#: The app's table the ``beside-block`` bodies update on a connection beside their block (one row
#: per key, seeded by the harness).
BESIDE_ROWS = sa.Table(
    "chaos_beside_rows",
    app_metadata,
    sa.Column("key", sa.String(200), primary_key=True),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("attempt_id", sa.String(64), nullable=False),
    sa.Column("written_at", sa.Float, nullable=False),
)
#: The rows the ``export`` scenario's bodies export, one row per exported row (no unique key: a
#: row exported twice shows).
EXPORT_ROWS = sa.Table(
    "chaos_export_rows",
    app_metadata,
    sa.Column("key", sa.String(200), nullable=False, index=True),
    sa.Column("row_id", sa.Integer, nullable=False),
)
#: The text forms of a write beside a block the ``beside-block`` scenario cycles through (each a
#: write a statement's first word does not reveal), by name.
BESIDE_FORMS = ("comment", "with-newline", "function", "call", "do", "select-into")

__all__ = [
    "APP_ROWS",
    "BESIDE_FORMS",
    "BESIDE_ROWS",
    "CHARGE",
    "EXPORT_ROWS",
    "NOTIFY",
    "TASK_NAME",
    "app_metadata",
]
