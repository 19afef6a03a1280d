"""Test helpers that behave like the real thing: :class:`ProviderStub`, an idempotent provider."""

from __future__ import annotations

from .provider import ProviderStub

__all__ = ["ProviderStub"]
