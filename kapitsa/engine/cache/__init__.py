"""What the engine keeps between tokens and turns: the per-layer caches (KV and recurrent state), speculative rollback, and the prefix cache with its disk tier."""
