"""The control plane: conductor, per-request interpreter, scheduler, streams, input checks."""
