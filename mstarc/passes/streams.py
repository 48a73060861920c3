"""streams: one stream buffer per (walk, streaming edge) with its chunk policy and capacity.

Requires: `verify` and `place` have run.
Ensures:  `model.stream_buffers` lists, for every `on stream` block of every walk, a
          `StreamBufferIR` with the policy, the item type, the largest chunk, the capacity in
          items (the bound that gives backpressure: the producer waits while the consumer
          lags by more than `capacity` unconsumed items), and the producer and consumer ranks
          (different ranks mean the items cross ranks as they are pushed). A stream from a
          walk input is produced at the conductor (rank 0): the client pushes its items.
Fails when: a policy's chunk is larger than the capacity the node allows (E044), which can
          only happen with an explicit `stream_capacity` node setting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mstarc import ir as I
from mstarc.diagnostics import DiagnosticSink
from mstarc.passes.verify import chunk_length

# How many chunks the buffer may hold beyond the one being consumed: deep enough that a
# decode loop never stalls on a consumer that runs in step with it, shallow enough that a
# stalled consumer stops its producer within a few steps.
CAPACITY_CHUNKS = 4


@dataclass(frozen=True)
class StreamBufferIR:
    id: str  # "<walk>:<edge id>"
    walk: str
    edge: str
    policy: I.ChunkPolicyIR
    item_type: I.ValueType  # one item: the producer port's type without its leading (count) dim
    chunk_items: int
    capacity: int
    producer_rank: int
    consumer_rank: int
    block: str  # the OnStream region id that consumes it

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "walk": self.walk, "edge": self.edge,
            "policy": {"kind": self.policy.kind, **self.policy.params},
            "item_type": self.item_type.to_json(), "chunk_items": self.chunk_items, "capacity": self.capacity,
            "producer_rank": self.producer_rank, "consumer_rank": self.consumer_rank, "block": self.block,
        }


def streams(model: I.ModelIR) -> I.ModelIR:
    sink = DiagnosticSink()
    buffers: list[StreamBufferIR] = []
    call_ranks = model.placement.call_ranks
    for walk in model.walks.values():
        producers = {}
        for c in I.walk_calls(walk):
            phase = model.nodes[c.node].phases[c.phase]
            for port in phase.outputs:
                producers.setdefault((c.node, port), c)
        for block in (r for r in I.iter_regions(walk.body) if isinstance(r, I.OnStream)):
            edge = model.edge(block.stream)
            assert edge is not None and edge.policy is not None  # verify guarantees it
            if edge.from_input:  # the client's chunks: the walk input's type, items along its first dim
                src_type = next(p.type for p in model.walks[edge.src_node].inputs if p.name == edge.src_port)
            else:
                src_type = model.nodes[edge.src_node].outputs[edge.src_port].type
            item = I.ValueType("tensor", src_type.dtype, src_type.dims[1:])
            chunk = chunk_length(edge.policy) or 1
            node = model.nodes[edge.dst_node]
            capacity = node.settings.get("stream_capacity", CAPACITY_CHUNKS * chunk)
            if isinstance(capacity, bool) or not isinstance(capacity, int):
                sink.error("E044", f"stream_capacity of '{node.name}' must be an integer number of items, "
                           f"not {capacity!r}", node.span)
                continue
            if capacity < chunk:
                sink.error("E044", f"stream {edge.id} needs room for a chunk of {chunk} items, but stream_capacity "
                           f"of '{node.name}' is {capacity}", node.span)
            producer = producers.get((edge.src_node, edge.src_port))
            consumer = next((r for r in I.iter_regions(block.body) if isinstance(r, I.Call)), None)
            prank = call_ranks[producer.id][0] if producer else 0
            crank = call_ranks[consumer.id][0] if consumer else prank
            buffers.append(StreamBufferIR(f"{walk.name}:{edge.id}", walk.name, edge.id, edge.policy, item, chunk,
                                          capacity, prank, crank, block.id))
    sink.check()
    return dataclasses.replace(model, stream_buffers=tuple(buffers))
