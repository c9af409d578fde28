"""FlashAttention-3 (vLLM 0.24.0's build, ../shared/peers/fa3) at every shape of `benches prefill`,
including a long prompt after a cached prefix, which the peer kit's script does not time. Run
`bash FA3DIR/setup.sh` first, then
    PYTHONPATH=/tmp/fa3site python3 scripts/device/fa3_prefill.py
Prints CSV: fa3_prefill,model,batch,len,prefix,us,TFLOPs. Without a prefix: causal varlen over
contiguous K/V (as the kit's script); with one: the prefix and the new tokens' K/V in a paged cache
(block size 16, shuffled blocks), causal from the end. FLOPs = 4·B·H·D·(L·P + L(L+1)/2), as ours.
Timed in CUDA graphs of four calls, as `benches prefill` times ours."""
import torch
from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func

MODELS = {"qwen2-0.5b": (14, 2, 64), "qwen3-0.6b": (16, 8, 128)}
SHAPES = [(1, 4096, 0), (16, 1024, 0), (256, 512, 0), (1, 16384, 4096)]
dev, bf, bs = "cuda", torch.bfloat16, 16


def timed(fn, calls=4, reps=10):
    """Median microseconds per call: a CUDA graph of `calls` back-to-back calls replayed ten times
    a sample (no Python or launch overhead; ours is timed the same way)."""
    for _ in range(3): fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls): fn()
    for _ in range(3): graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10): graph.replay()
        e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / (10 * calls) * 1e3)
    return sorted(times)[len(times) // 2]


def prefill(model, H, KVH, D, B, L, P):
    q = torch.randn(B * L, H, D, device=dev, dtype=bf)
    cu_q = torch.arange(0, B * L + 1, L, device=dev, dtype=torch.int32)
    if P == 0:
        k = torch.randn(B * L, KVH, D, device=dev, dtype=bf); v = torch.randn_like(k)
        f = lambda: flash_attn_varlen_func(q, k, v, max_seqlen_q=L, cu_seqlens_q=cu_q, max_seqlen_k=L,
                                           cu_seqlens_k=cu_q, causal=True, softmax_scale=D ** -0.5, fa_version=3)
    else:
        nb = (P + L + bs - 1) // bs
        kc = torch.randn(B * nb, bs, KVH, D, device=dev, dtype=bf); vc = torch.randn_like(kc)
        table = torch.randperm(B * nb, device=dev, dtype=torch.int32).view(B, nb)
        used = torch.full((B,), P + L, device=dev, dtype=torch.int32)
        f = lambda: flash_attn_varlen_func(q, kc, vc, max_seqlen_q=L, cu_seqlens_q=cu_q, max_seqlen_k=P + L,
                                           seqused_k=used, block_table=table, causal=True,
                                           softmax_scale=D ** -0.5, fa_version=3)
    t = timed(f)
    flops = 4 * B * H * D * (L * P + L * (L + 1) / 2)
    print(f"fa3_prefill,{model},{B},{L},{P},{t:.1f},{flops / t / 1e6:.1f}", flush=True)


def main():
    print("fa3", torch.__version__, torch.cuda.get_device_name(0))
    print("fa3_prefill,model,batch,len,prefix,us,TFLOPs")
    for m, heads in MODELS.items():
        for B, L, P in SHAPES:
            prefill(m, *heads, B, L, P); torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
