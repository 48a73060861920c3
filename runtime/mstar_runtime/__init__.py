"""M* runtime: conductor, workers and their building blocks (imported as ``mstar_runtime``)."""
