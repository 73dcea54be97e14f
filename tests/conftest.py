from __future__ import annotations

import os

import pytest

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The float32 references of the GPU tests are exact: MLX's CUDA backend otherwise runs float32
# matmuls in TF32 (MLX_ENABLE_TF32, default 1), ~1e-3 off, past those tests' 1e-5 tolerances.
# The kernels under test do their own arithmetic, so this changes only the references.
os.environ.setdefault("MLX_ENABLE_TF32", "0")


@pytest.fixture
def on_cpu():
    """Run the test on MLX's CPU device wherever it runs (the float32 references of CPU-side tests,
    e.g. kernel emulators and routing logic, would otherwise run in the GPU's matmul precision)."""
    import mlx.core as mx

    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


@pytest.fixture
def open_umask():
    """The common umask, under which plain writes would be readable by everyone."""
    import os

    old = os.umask(0o022)
    yield
    os.umask(old)
