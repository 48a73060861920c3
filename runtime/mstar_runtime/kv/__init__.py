"""The paged KV cache: the block manager (pages), the pool and attention backends."""
