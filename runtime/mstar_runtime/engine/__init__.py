"""Running one batched step of one node: the KV and stateless engines, CUDA graphs."""
