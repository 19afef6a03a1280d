"""The operator's side: recovery, retention, requeue and the ``celery fence`` command."""
