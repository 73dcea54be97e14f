"""The engine thread: the loop, the scheduler, the model runner, the decode batch, sampling and output shaping, memory admission."""
