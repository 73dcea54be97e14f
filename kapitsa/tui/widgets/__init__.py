"""Widgets: one class per file."""
