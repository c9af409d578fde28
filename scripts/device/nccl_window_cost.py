"""NCCL all-reduce cost with plain buffers against buffers in a symmetric window.

Run on a GPU machine with several GPUs of one host (device tool), one process per GPU:

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node N scripts/device/nccl_window_cost.py

NCCL 2.27+ runs collectives on buffers registered with `ncclCommWindowRegister(...,
NCCL_WIN_COLL_SYMMETRIC)` (allocated by `ncclMemAlloc`) with its symmetric-memory kernels,
which read the peers' buffers over NVLink directly. This script calls libnccl through ctypes
(the library the system loader finds, as the engine's cudarc does), captures 100 in-place bf16
all-reduces of [rows, hidden] into a CUDA graph per case, replays it 20 times, and rank 0 prints
the mean time of one all-reduce in microseconds for both kinds of buffer.
"""

import ctypes
import os

import torch
import torch.distributed as dist

# The same timing as all_reduce_cost.py (this script's folder is on the import path).
from all_reduce_cost import HIDDEN, graph_time_us

ROWS = [1, 32, 128, 256, 512]
NCCL_BFLOAT16 = 9
NCCL_SUM = 0
NCCL_WIN_COLL_SYMMETRIC = 1


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed: ncclResult {result}")


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    nccl = ctypes.CDLL("libnccl.so.2")
    version = ctypes.c_int()
    nccl.ncclGetVersion(ctypes.byref(version))
    uid = UniqueId()
    if rank == 0:
        check(nccl.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    raw = torch.tensor(list(bytes(uid)), dtype=torch.uint8)
    dist.broadcast(raw, 0)
    uid = UniqueId.from_buffer_copy(bytes(raw.tolist()))
    comm = ctypes.c_void_p()
    check(nccl.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), "ncclCommInitRank")
    largest = max(ROWS) * max(HIDDEN.values()) * 2
    window_buffer = ctypes.c_void_p()
    check(nccl.ncclMemAlloc(ctypes.byref(window_buffer), ctypes.c_size_t(largest)), "ncclMemAlloc")
    window = ctypes.c_void_p()
    check(
        nccl.ncclCommWindowRegister(
            comm, window_buffer, ctypes.c_size_t(largest), ctypes.byref(window), NCCL_WIN_COLL_SYMMETRIC
        ),
        "ncclCommWindowRegister",
    )
    plain = torch.zeros(largest // 2, dtype=torch.bfloat16, device="cuda")
    if rank == 0:
        print(f"NCCL {version.value}, {world} ranks, {torch.cuda.get_device_name()}")
        print("model,hidden,rows,us_plain,us_window")
    stream = torch.cuda.Stream()

    def time_all_reduce(pointer: int, count: int) -> float:
        def call() -> None:
            check(
                nccl.ncclAllReduce(
                    ctypes.c_void_p(pointer), ctypes.c_void_p(pointer), ctypes.c_size_t(count),
                    NCCL_BFLOAT16, NCCL_SUM, comm, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                ),
                "ncclAllReduce",
            )

        return graph_time_us(call, stream)

    for model, hidden in HIDDEN.items():
        for rows in ROWS:
            count = rows * hidden
            us_plain = time_all_reduce(plain.data_ptr(), count)
            us_window = time_all_reduce(window_buffer.value, count)
            if rank == 0:
                print(f"{model},{hidden},{rows},{us_plain:.1f},{us_window:.1f}", flush=True)
    torch.cuda.synchronize()
    nccl.ncclCommWindowDeregister(comm, window)
    nccl.ncclMemFree(window_buffer)
    nccl.ncclCommDestroy(comm)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
