"""DTensor (`parallelize_module`) against plain tensors with explicit collectives, on 2 gloo ranks (BENCHMARKS.md,
"Tensor parallel"): the per-call time of a row-parallel linear + all-reduce (o_proj's shape) and of a feed-forward
block (gate/up column-parallel, down row-parallel), and whether the outputs match.

Both sides hold the same shards of the same weights and read the same input; each rank runs one thread. Per
shape: (a) plain: `F.linear` on this rank's shard, `dist.all_reduce` (what `models/sharding.py` does), (b) DTensor:
the module given to `parallelize_module` on `init_device_mesh("cpu", (2,))` with `RowwiseParallel` (and
`ColwiseParallel` for the block), called on the same local tensors, and (c) the local matmuls alone (no
collective). Rounds alternate the three; each reports its median over rounds of the mean over `--calls` calls, in wall time
and in CPU time (the waits for the other rank left out: the dispatch and compute this rank spends).

    OMP_NUM_THREADS=1 python scripts/tp_dtensor.py                         # llada-small's widths: 640, 1728 (/2)
    OMP_NUM_THREADS=1 python scripts/tp_dtensor.py --rows 1,32,320 --rounds 9 --calls 100
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor


def timed(fn, calls: int) -> tuple[float, float]:
    """Wall and CPU seconds (this process's threads) per call of `fn`: CPU time leaves out the waits for the other
    rank, which on a shared machine are most of the wall time and its noise."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        done(fn())
    wall, cpu = (time.perf_counter() - start) / calls, (time.process_time() - cpu) / calls
    dist.barrier()
    return wall, cpu


def done(t: torch.Tensor) -> torch.Tensor:
    """`t` once its collective has finished: DTensor's local output may be an `AsyncCollectiveTensor`, whose
    all-reduce is only waited for when the tensor is used."""
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def rank_main(rank: int, args, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    d, f = args.hidden, args.ffn
    torch.manual_seed(0)  # the same full weights on both ranks
    o_proj, gate_up, down = nn.Linear(d, d, bias=False), nn.Linear(d, 2 * f, bias=False), nn.Linear(f, d, bias=False)
    local = slice(rank * d // 2, (rank + 1) * d // 2)
    o_shard = o_proj.weight[:, local].detach().clone()
    gu_full = gate_up.weight.detach().view(2, f, d)  # gate rows, then up rows
    gu_shard = gu_full[:, rank * f // 2:(rank + 1) * f // 2].reshape(f, d).clone()  # this rank's gate, then its up
    down_shard = down.weight[:, rank * f // 2:(rank + 1) * f // 2].detach().clone()
    d_gate, d_up = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)  # DTensor: gate and up shard alike
    with torch.no_grad():
        d_gate.weight.copy_(gu_full[0])
        d_up.weight.copy_(gu_full[1])
    d_o = parallelize_module(_copy(o_proj), mesh, RowwiseParallel())
    block = nn.ModuleDict({"gate": d_gate, "up": d_up, "down": _copy(down)})
    block = parallelize_module(block, mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                             "down": RowwiseParallel()})

    def plain_o(x):
        y = F.linear(x, o_shard)
        dist.all_reduce(y)
        return y

    def plain_block(x):
        gate, up = F.linear(x, gu_shard).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_shard)
        dist.all_reduce(y)
        return y

    def dtensor_block(x):
        return block["down"](F.silu(block["gate"](x)) * block["up"](x))

    def local_block(x):
        gate, up = F.linear(x, gu_shard).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down_shard)

    results = {}
    with torch.no_grad():
        for rows in args.rows:
            x = torch.randn(rows, d, generator=torch.Generator().manual_seed(rows))  # the same on both ranks
            x_local = x[:, local].contiguous()
            reference_o, reference_block = o_proj(x), down(F.silu(gate_up(x).view(rows, 2, f)[:, 0])
                                                           * gate_up(x).view(rows, 2, f)[:, 1])
            variants = {
                "o_proj": {"plain": lambda: plain_o(x_local), "dtensor": lambda: d_o(x_local),
                           "local matmuls": lambda: F.linear(x_local, o_shard)},
                "feed-forward": {"plain": lambda: plain_block(x), "dtensor": lambda: dtensor_block(x),
                                 "local matmuls": lambda: local_block(x)},
            }
            outputs = {"o_proj": (plain_o(x_local), done(d_o(x_local)), reference_o),
                       "feed-forward": (plain_block(x), done(dtensor_block(x)), reference_block)}
            for name, fns in variants.items():
                for fn in fns.values():
                    timed(fn, args.calls // 4)  # warm-up
                times = {key: [] for key in fns}
                for _ in range(args.rounds):
                    for key, fn in fns.items():
                        times[key].append(timed(fn, args.calls))
                plain, dt, ref = outputs[name]
                results[f"{name} rows {rows}"] = {
                    **{f"{key} us": 1e6 * statistics.median(w for w, _ in t) for key, t in times.items()},
                    **{f"{key} CPU us": 1e6 * statistics.median(c for _, c in t) for key, t in times.items()},
                    "dtensor == plain": bool(torch.equal(plain, dt)),
                    "max |dtensor - plain|": float((plain - dt).abs().max()),
                    "max |plain - unsharded|": float((plain - ref).abs().max())}
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


def _copy(linear: nn.Linear) -> nn.Linear:
    out = nn.Linear(linear.in_features, linear.out_features, bias=False)
    with torch.no_grad():
        out.weight.copy_(linear.weight)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=640, help="hidden width (llada-small: 640)")
    ap.add_argument("--ffn", type=int, default=1728, help="feed-forward width (llada-small: 1728)")
    ap.add_argument("--rows", default="1,32,320", help="rows per call (one; a cached block; a batch's canvas)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.spawn(rank_main, (args, free_port(), out), nprocs=2, join=True)
        with open(out) as fh:
            results = json.load(fh)
    print(f"2 gloo ranks, 1 thread each, hidden {args.hidden}, feed-forward {args.ffn}; microseconds per call (wall, "
          f"and CPU of rank 0's process), median of {args.rounds} rounds of {args.calls} calls\n")
    keys = list(next(iter(results.values())))
    print("| call | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{v:.1f}" if isinstance(v, float) and "us" in k else
                                          f"{v:.2e}" if isinstance(v, float) else str(v) for k, v in r.items()) + " |")


if __name__ == "__main__":
    main()
