"""The admin: the invoices, and celery-fence's jobs (read-only, with requeue and recover)."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
