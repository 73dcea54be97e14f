"""From a model reference to a loaded model: resolving the folder, reading config and weights, quantizing, fusing projections."""
