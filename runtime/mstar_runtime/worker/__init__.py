"""Workers (one per rank): in-process, worker processes, the wire, typed messages, TP steps."""
