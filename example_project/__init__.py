"""A small Celery project that uses celery-fence: a report and an export with external effects.

Read in this order: ``settings.py`` → ``app.py`` → ``tasks.py`` → ``notifications.py`` →
``storage.py`` / ``db.py``. ``python -m example_project.demo`` runs the whole story.
"""
