"""Test support shipped with kapitsa: tiny real-architecture checkpoints built on the spot, and a fake engine for surfaces that need no model."""
