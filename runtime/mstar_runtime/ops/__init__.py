"""The surface model code may import: the node contract, reading a NodeSpec and batch entries
(ports), fused ops, readback, TP (sampling: `mstar_runtime.sampling`)."""
