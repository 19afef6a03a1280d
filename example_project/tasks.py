"""The two jobs: a report and an export, both fenced.

Both publish through the fenced completion — only the attempt that still owns the job stores its
result — and both send their external effect through the outbox, which writes it in the same
transaction as that result. The report is also written to the app's own table, inside
``self.fence.transaction()``: that commit is fenced too. A stale attempt's rows, result and
effects are never recorded.
"""

from __future__ import annotations

import csv
import hashlib
import io
import time
from typing import Any

from celery_fence import FencedTask, PermanentError, storage_key

from . import db, settings, storage
from .app import app


def simulated_work() -> None:
    """Stands in for minutes of real work (the demo pauses a worker in the middle of it)."""
    time.sleep(settings.WORK_SECONDS)


@app.task(base=FencedTask, bind=True, fence_key=lambda report_id: f"report:{report_id}")
def build_report(self: Any, report_id: str) -> dict[str, Any]:
    orders = db.orders_up_to()  # collect the data
    simulated_work()
    report = {
        "report_id": report_id,
        "orders": len(orders),
        "revenue_cents": sum(o["amount_cents"] for o in orders),
        "generation": self.fence.generation,
    }
    # The app's own table: this commit lands only while this attempt still owns the job (the
    # lease is checked on entry, the store's generation at commit); otherwise nothing of it
    # commits and the attempt settles as stale.
    with self.fence.transaction() as conn:
        db.save_report(conn, report, attempt_id=self.fence.attempt_id)
    # Sent only if this attempt's result is the one stored; its key is the same on every retry.
    self.fence.effects.add("notify", {"report_id": report_id, "text": f"Report {report_id} ready"})
    return report  # published by the fenced completion: a stale attempt's write is rejected


@app.task(base=FencedTask, bind=True, fence_key=lambda export_id: f"export:{export_id}")
def generate_export(self: Any, export_id: str) -> dict[str, Any]:
    request = db.get_export(export_id)  # stored before the job was sent: stable id and version
    if request is None:
        raise PermanentError(f"no export request {export_id}")
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["order_id", "customer", "amount_cents"])
    for order in db.orders_up_to(request.input_version):  # the snapshot: same rows every re-run
        writer.writerow([order["id"], order["customer"], order["amount_cents"]])
    data = buffer.getvalue().encode()
    # Same job and input version, same object key: a re-run replaces the object, never adds one.
    object_key = storage_key(self.fence.key, request.input_version, suffix=".csv")
    with self.fence.guard():  # do not start the upload once the lease is lost
        storage.put(
            object_key, data, generation=self.fence.generation, attempt_id=self.fence.attempt_id
        )
    simulated_work()
    self.fence.effects.add(
        "email", {"to": request.email, "export_id": export_id, "object_key": object_key}
    )
    return {
        "export_id": export_id,
        "input_version": request.input_version,
        "object_key": object_key,
        "sha256": hashlib.sha256(data).hexdigest(),
        "generation": self.fence.generation,
    }
