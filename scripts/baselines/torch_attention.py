"""PyTorch scaled_dot_product_attention (contiguous KV, bf16) at the shapes of
`benches decode prefill`, plus the device's copy bandwidth, for comparison in one command."""
import torch, torch.nn.functional as F

dev, bf = "cuda", torch.bfloat16
print("torch", torch.__version__, torch.cuda.get_device_name(0))

def timed(fn, iters):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters): fn()
        e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / iters * 1e3)
    return sorted(times)[len(times) // 2]

x = torch.empty(1 << 29, device=dev, dtype=torch.uint8).random_(); y = torch.empty_like(x)
t = timed(lambda: y.copy_(x), 20)
print(f"copy_bandwidth_GBps,{2 * x.numel() / t / 1e3:.0f}")
del x, y

print("torch_decode,model,batch,context,us,kv_GBps")
for model, H, KVH, D in [("qwen2-0.5b", 14, 2, 64), ("qwen3-0.6b", 16, 8, 128)]:
    for B in [1, 16, 64, 256]:
        for C in [128, 1024, 4096, 16384]:
            q = torch.randn(B, H, 1, D, device=dev, dtype=bf)
            k = torch.randn(B, KVH, C, D, device=dev, dtype=bf); v = torch.randn_like(k)
            t = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 20)
            print(f"torch_decode,{model},{B},{C},{t:.1f},{2 * k.numel() * 2 / t / 1e3:.0f}")
            del q, k, v
print("torch_prefill,model,batch,len,us,TFLOPs")
for model, H, KVH, D in [("qwen2-0.5b", 14, 2, 64), ("qwen3-0.6b", 16, 8, 128)]:
    for B, L in [(1, 4096), (16, 1024), (256, 512)]:
        q = torch.randn(B, H, L, D, device=dev, dtype=bf)
        k = torch.randn(B, KVH, L, D, device=dev, dtype=bf); v = torch.randn_like(k)
        t = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), 5)
        flops = 4 * B * H * D * L * (L + 1) / 2
        print(f"torch_prefill,{model},{B},{L},{t:.1f},{flops / t / 1e6:.1f}")
        del q, k, v
