"""How fast a paged decode can read its KV cache in each block layout.

On the GPU machine: `python3 scripts/baselines/kv_layout_read.py > kv_layout.csv`.

A Triton kernel reads what one decode step's attention reads — for every (sequence, kv head),
the K and V rows of each of its context's blocks, through a shuffled block table — and only
sums them (no arithmetic worth the name: the read is the measurement). Two layouts of the same
pool: `nhd` = `[num_blocks, block_size, kv_heads, D]` (ours and vLLM's FlashAttention layout: a
block's head is `block_size` runs of `D` elements, `kv_heads · D` apart) and `hnd` =
`[num_blocks, kv_heads, block_size, D]` (FlashInfer's: a block's head is one contiguous run).
CUDA events around CUDA-graph replays, median of 20, after warm-up. Output: layout, heads,
batch, context, µs, GB/s of KV read.
"""

import statistics
import sys

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    print("triton is not installed", file=sys.stderr)
    sys.exit(1)


@triton.jit
def read_kv(
    k_ptr,
    v_ptr,
    tables_ptr,
    ctx_ptr,
    out_ptr,
    width,
    KV_HEADS: tl.constexpr,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
    HND: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)
    t = tl.arange(0, BLOCK)[:, None]
    d = tl.arange(0, D)[None, :]
    if HND:
        offs = (head * BLOCK + t) * D + d
    else:
        offs = (t * KV_HEADS + head) * D + d
    acc = tl.zeros([BLOCK, D], dtype=tl.float32)
    for j in range(0, tl.cdiv(ctx, BLOCK)):
        blk = tl.load(tables_ptr + seq * width + j).to(tl.int64)
        base = blk * (BLOCK * KV_HEADS * D)
        k = tl.load(k_ptr + base + offs)
        v = tl.load(v_ptr + base + offs)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + (seq * KV_HEADS + head), tl.sum(acc))


def time_graph(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main():
    torch.manual_seed(0)
    block, pool = 16, 70000
    print("layout,kv_heads,head_dim,batch,context,us,GB_s")
    for kv_heads, d in [(8, 128), (2, 64)]:
        k = torch.randn(pool * block * kv_heads * d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for batch, context in [(256, 1024), (199, 1300), (78, 1600), (32, 2000), (256, 4096)]:
            width = context // block
            if batch * width > pool:
                continue
            tables = torch.randperm(pool, device="cuda")[: batch * width].to(torch.int32)
            ctx = torch.full((batch,), context, device="cuda", dtype=torch.int32)
            out = torch.empty(batch * kv_heads, device="cuda", dtype=torch.float32)
            nbytes = 2 * batch * context * kv_heads * d * 2
            for layout in ["nhd", "hnd"]:
                def run():
                    read_kv[(kv_heads, batch)](
                        k, v, tables, ctx, out, width,
                        KV_HEADS=kv_heads, BLOCK=block, D=d, HND=layout == "hnd",
                    )
                us = time_graph(run)
                print(f"{layout},{kv_heads},{d},{batch},{context},{us:.1f},{nbytes / us / 1e3:.0f}")


if __name__ == "__main__":
    main()
