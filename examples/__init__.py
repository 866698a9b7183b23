"""Runnable examples; `python -m examples.demo` from the repository root."""
