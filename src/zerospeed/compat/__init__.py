"""Thin adapters that give DeepSpeed-only names (no zerospeed concept of their own) a home.

Each module here is served under a DeepSpeed path by ``zerospeed/_aliases.py`` and delegates to
zerospeed's real code; none holds a second implementation.
"""
