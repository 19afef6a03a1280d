"""The SQL of the ``beside-block`` scenario's writes (the workload runs it; the harness creates
the routines it calls)."""

from __future__ import annotations


def beside_statement(form: str, key: str, gen: int, attempt: str, t: float) -> str:
    """One write to ``chaos_beside_rows`` (or, ``select-into``, a new table) whose first word is
    not a writing verb: the forms of issue 31 item 1. Values are inlined (the ``do`` block takes
    no parameters; the others alike, for one code path): our own key, generation, attempt and
    time, quoted."""
    k, a = key.replace("'", "''"), attempt.replace("'", "''")
    sets = f"generation = {int(gen)}, attempt_id = '{a}', written_at = {float(t)!r}"
    args = f"'{k}', {int(gen)}, '{a}', {float(t)!r}"
    return {
        "comment": f"/* audit */ UPDATE chaos_beside_rows SET {sets} WHERE key = '{k}'",
        "with-newline": f"WITH d AS (UPDATE\nchaos_beside_rows SET {sets} WHERE key = '{k}' "
        "RETURNING 1) SELECT count(*) FROM d",
        "function": f"SELECT chaos_beside_write({args})",
        "call": f"CALL chaos_beside_proc({args})",
        "do": f"DO $$BEGIN UPDATE chaos_beside_rows SET {sets} WHERE key = '{k}'; END$$",
        "select-into": f"SELECT '{k}'::text AS key, {int(gen)} AS generation INTO "
        f"chaos_beside_into_{int(gen)}_{attempt[:12]}",
    }[form]


#: What ``chaos_beside_write`` / ``chaos_beside_proc`` are (created by the harness).
BESIDE_ROUTINES = (
    "CREATE OR REPLACE FUNCTION chaos_beside_write(k text, g bigint, a text, t float8) "
    "RETURNS void LANGUAGE sql AS $$ UPDATE chaos_beside_rows SET generation = g, "
    "attempt_id = a, written_at = t WHERE key = k $$",
    "CREATE OR REPLACE PROCEDURE chaos_beside_proc(k text, g bigint, a text, t float8) "
    "LANGUAGE sql AS $$ UPDATE chaos_beside_rows SET generation = g, attempt_id = a, "
    "written_at = t WHERE key = k $$",
)
