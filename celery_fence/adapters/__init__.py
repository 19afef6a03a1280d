"""Celery's side: the task base class, the worker request, Celery events and log records."""
