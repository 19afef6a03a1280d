"""The billing example's Django project; its Celery app loads with Django (the standard way)."""

from .celery import app as celery_app

__all__ = ["celery_app"]
