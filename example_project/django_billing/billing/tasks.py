"""Billing an invoice: the slow pricing outside, the write inside ``self.fence.atomic()``."""

from celery import shared_task
from django.db import connection, transaction

from celery_fence import FencedTask

from .models import Invoice

LINES = {"acme": [1200, 450, 99], "globex": [30000]}


def price(invoice: Invoice) -> list[int]:
    """The slow part (a pricing service, say): no lock held, nothing written."""
    return LINES.get(invoice.customer, [100])


@shared_task(base=FencedTask, bind=True, fence_key=lambda invoice_id: f"invoice:{invoice_id}")
def bill_invoice(self, invoice_id):
    lines = price(Invoice.objects.get(pk=invoice_id))
    with self.fence.atomic():  # Django's transaction.atomic, its commit fenced
        inv = Invoice.objects.select_for_update().get(pk=invoice_id)
        inv.total_cents = sum(lines)
        inv.billed_generation = self.fence.generation
        inv.billed_attempt = self.fence.attempt_id
        inv.save()
    return {
        "invoice": invoice_id,
        "total_cents": inv.total_cents,
        "generation": self.fence.generation,
        "database": connection.settings_dict["NAME"],
    }


@shared_task(
    base=FencedTask, bind=True, fence_key=lambda invoice_id: f"invoice-unsafe:{invoice_id}"
)
def bill_invoice_unsafe(self, invoice_id):
    """The same write in a plain ``transaction.atomic()``: the result is fenced, the row is not.
    A paused stale attempt overwrites the newer attempt's row (the tests show it)."""
    lines = price(Invoice.objects.get(pk=invoice_id))
    with transaction.atomic():
        inv = Invoice.objects.select_for_update().get(pk=invoice_id)
        inv.total_cents = sum(lines)
        inv.billed_generation = self.fence.generation
        inv.billed_attempt = self.fence.attempt_id
        inv.save()
    return {"invoice": invoice_id, "total_cents": inv.total_cents}
