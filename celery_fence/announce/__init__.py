"""Announcements: every transition as data (one table), and how it is logged, signalled, sent to
Flower as a Celery event, and kept off the log records of payloads."""
