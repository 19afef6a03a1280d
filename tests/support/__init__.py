"""Shared test support: service URLs, per-test isolation, real worker processes."""
