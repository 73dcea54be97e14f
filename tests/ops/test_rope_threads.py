"""Models are built on the caller's thread and run on the engine thread: a Rope must not keep lazy
arrays tied to the building thread's stream."""

from __future__ import annotations

import threading

import mlx.core as mx

from kapitsa.engine.ops.rope import Rope

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}


def test_rope_built_here_runs_on_another_thread() -> None:
    ropes = [Rope(16, 10000.0), Rope(16, 10000.0, YARN)]
    x = mx.ones((1, 2, 3, 16))
    mx.eval(x)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for rope in ropes:
                mx.eval(rope(x, 5), rope.at_positions(x, mx.array([[5, 6, 6]])))
        except BaseException as err:  # noqa: BLE001 - reported to the test thread
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors, errors
