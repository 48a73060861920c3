"""Probe: which teardown of a NCCL group returns once a CUDA graph captured an all-reduce.

A tensor-parallel Orpheus run on two H200s hung at exit in `destroy_process_group` (and an
abort in its place did not return within 10 s), as pytorch/pytorch#115388 describes for
groups whose collectives were captured in CUDA graphs. This runs the pattern alone, once per
teardown `--mode`, two processes under torch.distributed.run:

  destroy          destroy_process_group() with the graph alive
  release-destroy  the graph (and its pool) dropped, device synchronised, then destroy
  abort            distributed_c10d._abort_process_group() with the graph alive
  release-abort    the graph dropped, then abort

    for m in destroy release-destroy abort release-abort; do
      timeout 60 python -m torch.distributed.run --nproc-per-node 2 tools/probes/nccl_teardown.py --mode $m
    done

Each rank prints how long the teardown took; a mode that hangs is cut by `timeout`.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("destroy", "release-destroy", "abort", "release-abort"), required=True)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    group = dist.new_group([0, 1])  # as runtime/mstar_runtime/ops/tp.py: the TP collectives have a group of their own
    x = torch.full((64, 3072), float(rank + 1), device="cuda")
    for _ in range(3):  # warm-up outside the capture, as the graph runner does
        dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(x, group=group)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    print(f"[rank {rank}] captured and replayed an all-reduce; tearing down with '{args.mode}'", flush=True)
    t0 = time.perf_counter()
    if args.mode.startswith("release"):
        del graph
        gc.collect()
        torch.cuda.synchronize()
    if args.mode.endswith("abort"):
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
    print(f"[rank {rank}] '{args.mode}' returned in {time.perf_counter() - t0:.2f} s", flush=True)


if __name__ == "__main__":
    main()
