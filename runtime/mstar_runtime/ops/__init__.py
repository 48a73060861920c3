"""The surface model code may import: the node contract, fused ops, sampling, readback, TP."""
