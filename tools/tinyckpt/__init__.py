"""Builds kapitsa's tiny trained checkpoints (see tools/train_checkpoints.py and docs/checkpoints.md)."""
