from django.db import models


class Invoice(models.Model):
    customer = models.CharField(max_length=100)
    total_cents = models.BigIntegerField(null=True)
    #: which attempt billed it (the fence's generation and attempt id): tests compare them with
    #: the fence store's job
    billed_generation = models.BigIntegerField(null=True)
    billed_attempt = models.CharField(max_length=64, blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"invoice {self.pk} ({self.customer})"
