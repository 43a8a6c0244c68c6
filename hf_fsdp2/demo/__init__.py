"""The demo: a real model and a measurable task shipped inside PyPI packages (not part of the training core)."""
