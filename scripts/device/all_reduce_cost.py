"""NCCL all-reduce cost at the shapes of a tensor-parallel decode step, in CUDA graphs.

Run on a GPU machine with several GPUs of one host (device tool), one process per GPU:

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node N scripts/device/all_reduce_cost.py

For each hidden size (Qwen2.5-7B 3,584, 32B 5,120, 72B 8,192) and row count, one bf16
all-reduce of [rows, hidden] is captured 100 times into a CUDA graph; the graph is replayed
20 times and rank 0 prints the mean time of one all-reduce in microseconds. A decode step of a
model with L layers issues 2·L of them (after the attention and after the MLP).
"""

import os

import torch
import torch.distributed as dist

HIDDEN = {"qwen2-7b": 3584, "qwen2-32b": 5120, "qwen2-72b": 8192}
LAYERS = {"qwen2-7b": 28, "qwen2-32b": 64, "qwen2-72b": 80}
ROWS = [1, 8, 32, 64, 128, 256, 512, 8192]
CALLS = 100
REPLAYS = 20


def graph_time_us(call, stream: torch.cuda.Stream) -> float:
    """Mean microseconds of `call()` (one collective): 3 eager warm-up calls (NCCL sets up its
    channels on first use), CALLS calls captured into a CUDA graph, REPLAYS timed replays after
    one untimed replay and a barrier."""
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS):
            call()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (REPLAYS * CALLS)


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    if rank == 0:
        print(f"NCCL {torch.cuda.nccl.version()}, {world} ranks, {torch.cuda.get_device_name()}")
        print("model,hidden,rows,us_per_all_reduce,ms_per_step(2*layers)")
    stream = torch.cuda.Stream()
    for model, hidden in HIDDEN.items():
        for rows in ROWS:
            x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
            us = graph_time_us(lambda: dist.all_reduce(x), stream)
            if rank == 0:
                step_ms = us * 2 * LAYERS[model] / 1000
                print(f"{model},{hidden},{rows},{us:.1f},{step_ms:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
