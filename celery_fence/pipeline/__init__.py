"""One attempt, claim -> register -> body -> settle, and the values it passes along: no Celery
here."""
