"""Opening an invoice: the row and its billing job commit together
(``celery_fence.contrib.django.enqueue``)."""

from django.db import transaction

from celery_fence.contrib.django import enqueue

from .models import Invoice
from .tasks import bill_invoice


def open_invoice(customer: str) -> Invoice:
    """A new invoice, billed by a worker once it is committed. The job's row is written in this
    transaction: rolled back, neither exists; committed, the job is sent (or, if this process
    dies first, ``celery fence recover`` sends it)."""
    with transaction.atomic():
        inv = Invoice.objects.create(customer=customer)
        enqueue(bill_invoice, args=(inv.pk,))
    return inv
