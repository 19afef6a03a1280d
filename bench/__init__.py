"""celery-fence benchmark: run ``python -m bench --help`` from the repository root."""
