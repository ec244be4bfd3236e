"""Renderers: a suite's ``results.json`` into ``table.md`` (and plots), re-runnable without measuring again."""
