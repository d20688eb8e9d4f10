"""Shared utilities with no science in them: atomic files (``io``), cache folders (``caches``), interrupts, progress
lines and the memory budget (``budget``).

May import: nothing of flowsim. Imported by every layer above.
"""
