"""kapitsa: a local inference engine and coding-agent launcher for hybrid models on MLX."""

__version__ = "0.1.0"
