"""The engine core: the scheduler, the paged KV block pool and its prefix cache, the
router over replicas, each replica's step, and what they measure."""
