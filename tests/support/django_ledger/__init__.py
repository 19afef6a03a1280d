"""A Django app for the tests of ``fence.atomic()``: one model, its table made by the fixture."""
