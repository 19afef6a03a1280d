-- The fenced statements of celery-fence, written out and named: every write of the task's path,
-- the operator's and recovery's compare-and-sets, the step and checkpoint rows, the transition
-- and outbox rows, and the PostgreSQL parts that ride along a fenced write in one statement.
-- Loaded once at import by celery_fence.store.queries (queries.STATEMENTS); reads and operator
-- statements built with SQLAlchemy Core are in sql.py, the outbox's in outbox_sql.py.
--
-- The format, as procrastinate's queries.sql:
--   -- name: <name>               a statement for every dialect
--   -- name: <name> (postgresql)  ... or for one dialect, where they differ
-- Lines starting with "--" inside a block are comments, not sent. Parameters are :name
-- (rendered %(name)s on PostgreSQL); "::jsonb" casts are dropped on SQLite, which keeps JSON as
-- text. Each write of a job row returns (key, generation, attempt_id, attempts) of the row it
-- changed, or no row when its condition did not hold: the caller turns that into a domain error.
--
-- The conditions, by name:
--   the fence (this attempt owns the running row):
--     key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'
--   a registration (a strictly greater generation of a live job):
--     fence_jobs.status NOT IN ('completed', 'dead') AND fence_jobs.generation < excluded.generation
--   the row as it was read (operators' compare-and-set):
--     key = :key AND status = :was_status AND generation = :generation AND attempt_id = :attempt_id
--   ... and not moved since (recovery's): the same AND updated_at = :was_updated_at


-- == registration ===============================================================================

-- name: register (postgresql)
-- Takes the row only for a strictly greater generation of a live job. Over a 'failed' row (a
-- call in the caller's thread raised to its caller) the attempt count starts again. Returns the
-- re-run number (fence_run) the stored request carries, an integer or NULL, and, when it took
-- over a row another attempt left 'running', when that row last moved (else NULL): its subquery
-- reads the statement's snapshot, the row as it was before this statement changed it.
INSERT INTO fence_jobs (key, task_name, status, generation, attempt_id, attempts, request,
                        created_at, updated_at)
VALUES (:key, :task_name, 'running', :generation, :attempt_id, 1, :request::jsonb, :now, :now)
ON CONFLICT (key) DO UPDATE SET generation = excluded.generation,
    attempt_id = excluded.attempt_id, status = 'running',
    attempts = CASE WHEN fence_jobs.status = 'failed' THEN 1 ELSE fence_jobs.attempts + 1 END,
    updated_at = excluded.updated_at, retry_at = NULL
WHERE fence_jobs.status NOT IN ('completed', 'dead')
    AND fence_jobs.generation < excluded.generation
RETURNING key, generation, attempt_id, attempts,
    CASE WHEN jsonb_typeof(fence_jobs.request #> '{execution,headers,fence_run}') = 'number'
    THEN fence_jobs.request #>> '{execution,headers,fence_run}' END AS run,
    (SELECT previous.updated_at FROM fence_jobs AS previous WHERE previous.key = :key
        AND previous.status = 'running' AND previous.attempt_id <> :attempt_id
        AND previous.generation > 0) AS took_over_from

-- name: register (sqlite)
-- As on PostgreSQL; json_type() raises on text that is not JSON: json_valid() first (CASE
-- evaluates lazily).
INSERT INTO fence_jobs (key, task_name, status, generation, attempt_id, attempts, request,
                        created_at, updated_at)
VALUES (:key, :task_name, 'running', :generation, :attempt_id, 1, :request, :now, :now)
ON CONFLICT (key) DO UPDATE SET generation = excluded.generation,
    attempt_id = excluded.attempt_id, status = 'running',
    attempts = CASE WHEN fence_jobs.status = 'failed' THEN 1 ELSE fence_jobs.attempts + 1 END,
    updated_at = excluded.updated_at, retry_at = NULL
WHERE fence_jobs.status NOT IN ('completed', 'dead')
    AND fence_jobs.generation < excluded.generation
RETURNING key, generation, attempt_id, attempts,
    CASE WHEN json_valid(fence_jobs.request) THEN CASE
    WHEN json_type(fence_jobs.request, '$.execution.headers.fence_run') = 'integer'
    THEN json_extract(fence_jobs.request, '$.execution.headers.fence_run') END END AS run


-- == the endings of a running attempt: fenced on the owner =====================================

-- name: complete
-- The result, completed: only where this attempt still owns the running row.
UPDATE fence_jobs SET status = 'completed', result = :result::jsonb, updated_at = :now,
    finished_at = :now, error_type = NULL, error_message = NULL
WHERE key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'
RETURNING key, generation, attempt_id, attempts

-- name: retry
-- 'retrying' until :retry_at, where this attempt owns the running row; the error columns kept.
UPDATE fence_jobs SET status = 'retrying', updated_at = :now, retry_at = :retry_at
WHERE key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'
RETURNING key, generation, attempt_id, attempts

-- name: retry_with_error
UPDATE fence_jobs SET status = 'retrying', updated_at = :now, retry_at = :retry_at,
    error_type = :error_type, error_message = :error_message
WHERE key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'
RETURNING key, generation, attempt_id, attempts

-- name: dead
-- 'dead', where this attempt owns the running row.
UPDATE fence_jobs SET status = 'dead', updated_at = :now, finished_at = :now, retry_at = NULL
WHERE key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'
RETURNING key, generation, attempt_id, attempts

-- name: dead_with_error
UPDATE fence_jobs SET status = 'dead', updated_at = :now, finished_at = :now, retry_at = NULL,
    error_type = :error_type, error_message = :error_message
WHERE key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'
RETURNING key, generation, attempt_id, attempts

-- name: dead_counted
-- ... and the attempt count set to :attempts.
UPDATE fence_jobs SET status = 'dead', updated_at = :now, finished_at = :now, retry_at = NULL,
    attempts = :attempts
WHERE key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'
RETURNING key, generation, attempt_id, attempts

-- name: dead_counted_with_error
UPDATE fence_jobs SET status = 'dead', updated_at = :now, finished_at = :now, retry_at = NULL,
    attempts = :attempts, error_type = :error_type, error_message = :error_message
WHERE key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'
RETURNING key, generation, attempt_id, attempts

-- name: caller_failed
-- 'failed' (an attempt in the caller's thread raised to its caller), where this attempt owns
-- the running row.
UPDATE fence_jobs SET status = 'failed', updated_at = :now, finished_at = :now, retry_at = NULL
WHERE key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'
RETURNING key, generation, attempt_id, attempts

-- name: caller_failed_with_error
UPDATE fence_jobs SET status = 'failed', updated_at = :now, finished_at = :now, retry_at = NULL,
    error_type = :error_type, error_message = :error_message
WHERE key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'
RETURNING key, generation, attempt_id, attempts


-- == dead without a running attempt ============================================================

-- name: dead_refused
-- A registration the database refused, 'dead' at once, fenced like a registration.
INSERT INTO fence_jobs (key, task_name, status, generation, attempt_id, attempts, request,
                        created_at, updated_at, finished_at, error_type, error_message)
VALUES (:key, :task_name, 'dead', :generation, :attempt_id, 1, :request::jsonb, :now, :now, :now,
        :error_type, :error_message)
ON CONFLICT (key) DO UPDATE SET task_name = excluded.task_name, status = excluded.status,
    generation = excluded.generation, attempt_id = excluded.attempt_id,
    request = excluded.request, updated_at = excluded.updated_at,
    finished_at = excluded.finished_at, error_type = excluded.error_type,
    error_message = excluded.error_message, attempts = fence_jobs.attempts + 1
WHERE fence_jobs.status NOT IN ('completed', 'dead')
    AND fence_jobs.generation < excluded.generation
RETURNING key, generation, attempt_id, attempts

-- name: dead_unregistered
-- A message that cannot be registered kept as a 'dead' job; over an existing row only when it
-- is 'pending' (its re-sent message failed again).
INSERT INTO fence_jobs (key, task_name, status, generation, attempt_id, attempts, request,
                        created_at, updated_at, finished_at, error_type, error_message)
VALUES (:key, :task_name, 'dead', 0, '-', 0, :request::jsonb, :now, :now, :now,
        :error_type, :error_message)
ON CONFLICT (key) DO UPDATE SET status = 'dead', updated_at = excluded.updated_at,
    finished_at = excluded.finished_at, error_type = excluded.error_type,
    error_message = excluded.error_message
WHERE fence_jobs.status = 'pending'
RETURNING key, generation, attempt_id, attempts

-- name: dead_unregistered_new
-- ... only as a new row: an existing one (a 'pending' one too) is left to the caller.
INSERT INTO fence_jobs (key, task_name, status, generation, attempt_id, attempts, request,
                        created_at, updated_at, finished_at, error_type, error_message)
VALUES (:key, :task_name, 'dead', 0, '-', 0, :request::jsonb, :now, :now, :now,
        :error_type, :error_message)
ON CONFLICT (key) DO NOTHING
RETURNING key, generation, attempt_id, attempts

-- name: dead_unrun
-- A message that never ran, 'dead' on the row as it was read (it waits for this message).
UPDATE fence_jobs SET status = 'dead', updated_at = :now, finished_at = :now, retry_at = NULL,
    error_type = :error_type, error_message = :error_message
WHERE key = :key AND status = :was_status AND generation = :generation
    AND attempt_id = :attempt_id
RETURNING key, generation, attempt_id, attempts

-- name: dead_stranded
-- A stranded job recovery gives up on, 'dead' on the row as it read it, unmoved since.
UPDATE fence_jobs SET status = 'dead', updated_at = :now, finished_at = :now, retry_at = NULL,
    error_type = :error_type, error_message = :error_message
WHERE key = :key AND status = :was_status AND generation = :generation
    AND attempt_id = :attempt_id AND updated_at = :was_updated_at
RETURNING key, generation, attempt_id, attempts


-- == the operator's and recovery's compare-and-sets ============================================

-- name: requeue
-- A dead (or, on purpose, a completed) job back to 'pending' with a fresh attempt budget, its
-- stored result kept until a new completion replaces it; on the row as it was read.
UPDATE fence_jobs SET status = 'pending', attempts = 0, updated_at = :now, finished_at = NULL,
    retry_at = NULL
WHERE key = :key AND status = :was_status AND generation = :generation
    AND attempt_id = :attempt_id
RETURNING key, generation, attempt_id, attempts

-- name: requeue_rerun
-- ... a completed job's re-run: with its stored request carrying the run's number.
UPDATE fence_jobs SET status = 'pending', attempts = 0, updated_at = :now, finished_at = NULL,
    retry_at = NULL, request = :request::jsonb
WHERE key = :key AND status = :was_status AND generation = :generation
    AND attempt_id = :attempt_id
RETURNING key, generation, attempt_id, attempts

-- name: restore_finished
-- A requeued job back to 'dead'/'completed' as it was (its message could not be sent).
UPDATE fence_jobs SET status = :status, attempts = :attempts, finished_at = :finished_at,
    updated_at = :now
WHERE key = :key AND status = :was_status AND generation = :generation
    AND attempt_id = :attempt_id
RETURNING key, generation, attempt_id, attempts

-- name: take_for_resend
-- A stranded job to 'pending' for a re-send, only if unmoved since recovery read it.
UPDATE fence_jobs SET status = 'pending', updated_at = :now, retry_at = NULL
WHERE key = :key AND status = :was_status AND generation = :generation
    AND attempt_id = :attempt_id AND updated_at = :was_updated_at
RETURNING key, generation, attempt_id, attempts


-- == steps and checkpoints (fence.step(), fence.checkpoint()) ==================================

-- name: step_done
-- A completed step's row: inserted only where this attempt owns the running job row, never over
-- an existing one (a completed step is never overwritten). Returns its name, or no row.
INSERT INTO fence_steps (key, name, generation, attempt_id, value, size, created_at, updated_at)
SELECT key, :name, generation, attempt_id, :value::jsonb, :size, :now, :now
FROM fence_jobs
WHERE key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'
ON CONFLICT (key, name) DO NOTHING
RETURNING name

-- name: checkpoint
-- The job's checkpoint (step '@checkpoint'): written only where this attempt owns the running
-- job row, and over a stored one only from the same or a newer generation.
INSERT INTO fence_steps (key, name, generation, attempt_id, value, size, created_at, updated_at)
SELECT key, '@checkpoint', generation, attempt_id, :value::jsonb, :size, :now, :now
FROM fence_jobs
WHERE key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'
ON CONFLICT (key, name) DO UPDATE SET value = excluded.value, size = excluded.size,
    generation = excluded.generation, attempt_id = excluded.attempt_id,
    updated_at = excluded.updated_at
WHERE fence_steps.generation <= excluded.generation
RETURNING name


-- == transition rows and staged outbox rows ====================================================

-- name: transition (postgresql)
-- One transition row; on PostgreSQL it returns its id (the raw path fetches a row).
INSERT INTO fence_transitions (key, generation, attempt_id, action, reason, at)
VALUES (:key, :generation, :attempt_id, :action, :reason, :now)
RETURNING id

-- name: transition (sqlite)
INSERT INTO fence_transitions (key, generation, attempt_id, action, reason, at)
VALUES (:key, :generation, :attempt_id, :action, :reason, :now)

-- name: outbox_insert (sqlite)
-- A staged effect, in its completion's transaction. An existing idempotency key is ignored: with
-- the fence on, a job completes once, so this never fires.
INSERT INTO fence_outbox (key, name, idempotency_key, payload, status, attempts, available_at,
                          created_at)
VALUES (:key, :name, :idempotency_key, :payload, 'pending', 0, :now, :now)
ON CONFLICT (idempotency_key) DO NOTHING

-- name: sync_ending (sqlite)
-- Before a job's ending: synced to disk at its COMMIT (the WAL fsynced: an OS crash or power loss
-- after the ack cannot take it back); sync_default after it, the connection's default for the
-- rest (a registration, like PostgreSQL's, may be lost to an OS crash: it costs a re-run).
PRAGMA synchronous=FULL

-- name: sync_default (sqlite)
PRAGMA synchronous=NORMAL

-- name: clear_steps (sqlite)
-- A completed job's steps and checkpoint, deleted in its completion's transaction.
DELETE FROM fence_steps WHERE key = :key


-- == PostgreSQL: what rides along a fenced write, in its one statement =========================
-- sql.pg_with_records() puts the write in "WITH fenced AS (...)", then these parts in this
-- order (the ones the write needs), then "SELECT * FROM fenced WHERE <its commit condition>".

-- name: with_transition (postgresql)
-- Its transition row (:action, :reason), only when the write changed a row.
, transition AS (
    INSERT INTO fence_transitions (key, generation, attempt_id, action, reason, at)
    SELECT key, generation, attempt_id, CAST(:action AS VARCHAR), CAST(:reason AS VARCHAR), :now
    FROM fenced)

-- name: with_effects (postgresql)
-- Its staged outbox rows (:effects, a JSON array of {"name", "idempotency_key", "payload"}).
, effects AS (
    INSERT INTO fence_outbox (key, name, idempotency_key, payload, status, attempts,
                              available_at, created_at)
    SELECT f.key, e.name, e.idempotency_key, e.payload, 'pending', 0, :now, :now
    FROM fenced f CROSS JOIN jsonb_to_recordset(:effects::jsonb)
        AS e(name text, idempotency_key text, payload jsonb)
    ON CONFLICT (idempotency_key) DO NOTHING)

-- name: with_cleared_steps (postgresql)
-- A completed job's steps and checkpoint, deleted.
, cleared AS (DELETE FROM fence_steps WHERE key IN (SELECT key FROM fenced))

-- name: durable_commit (postgresql)
-- The statement's commit waits for its local WAL flush even where the server, the database or
-- the role turned synchronous_commit off ('local' for this transaction only; any other setting
-- kept). A job's ending is what the ack waits for: it must survive a crash of the database. An
-- uncorrelated subquery: PostgreSQL runs it once, first, whether or not the write matched.
(SELECT CASE WHEN current_setting('synchronous_commit') = 'off'
    THEN set_config('synchronous_commit', 'local', true) ELSE 'kept' END) IS NOT NULL

-- name: async_commit (postgresql)
-- The statement's commit does not wait for its WAL flush (synchronous_commit off for this
-- transaction only). Only the registration's: docs/design.md, "One durable commit per task".
(SELECT set_config('synchronous_commit', 'off', true)) = 'off'
