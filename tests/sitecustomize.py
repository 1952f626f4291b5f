"""Imported at the start of every Python process a test starts (tests/ is on
their PYTHONPATH): while a test not marked `slow` runs, its subprocesses
refuse to compile a package too (compile_guard.py)."""

from compile_guard import guard_subprocess

guard_subprocess()
