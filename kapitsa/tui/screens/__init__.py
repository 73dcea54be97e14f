"""Screens: one class per file."""
