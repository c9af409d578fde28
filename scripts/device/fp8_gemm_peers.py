"""FP8 GEMM at decode sizes in PyTorch, beside bf16: what cuBLASLt and PyTorch's row-wise kernel
reach on the products of Qwen2.5-7B, to set the target of our FP8 products.

Usage (on the GPU machine): python3 scripts/device/fp8_gemm_peers.py [--ms 1,16,64,256]

Per product and M, µs per call (CUDA graph of back-to-back calls over enough weight copies that
they do not stay in L2): bf16 `F.linear`; `torch._scaled_mm` E4M3 x E4M3 -> bf16 with one scale
per tensor (cuBLASLt); the same with a scale per row of x and per output feature (PyTorch's
row-wise path, as our per-token x per-feature scales); and the weight bytes' bound at the
measured bf16 copy bandwidth. The activations' quantisation is not included (ours and vLLM's
each take a pass of their own).
"""

import argparse

import torch

PRODUCTS = [  # name, K (input), N (output features): Qwen2.5-7B
    ("qkv", 3584, 4608),
    ("o_proj", 3584, 3584),
    ("gate_up", 3584, 37888),
    ("down", 18944, 3584),
]
L2_ROTATION_BYTES = 512 << 20


def graph_us(calls, reps=5):
    """Mean µs per call of `calls` (a list of thunks) replayed as one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(calls))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="1,16,64,256")
    args = parser.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    print("torch", torch.__version__, torch.cuda.get_device_name(0))
    # The copy bandwidth the bound is taken at.
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy_us = graph_us([lambda: b.copy_(a)] * 8)
    bandwidth = 2 * a.numel() / (copy_us * 1e-6)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    del a, b
    print("product,M,K,N,bf16_us,fp8_tensor_us,fp8_rowwise_us,fp8_bytes_bound_us")
    for name, k, n in PRODUCTS:
        copies = max(1, L2_ROTATION_BYTES // (k * n))
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03 for _ in range(copies)]
        w8 = [w.to(torch.float8_e4m3fn) for w in w16]
        one = torch.ones((), device="cuda")
        for m in ms:
            x16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x8 = x16.to(torch.float8_e4m3fn)
            # _scaled_mm wants M a multiple of 16 for some paths: pad as the engines do.
            rows = max(16, (m + 15) // 16 * 16)
            x8p = torch.zeros(rows, k, device="cuda", dtype=torch.float8_e4m3fn)
            x8p[:m] = x8
            row_scale = torch.ones(rows, 1, device="cuda")
            col_scale = torch.ones(1, n, device="cuda")
            bf16 = graph_us([lambda w=w: torch.nn.functional.linear(x16, w) for w in w16])
            tensor = graph_us(
                [
                    lambda w=w: torch._scaled_mm(x8p, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                    for w in w8
                ]
            )
            try:
                rowwise = graph_us(
                    [
                        lambda w=w: torch._scaled_mm(
                            x8p, w.t(), scale_a=row_scale, scale_b=col_scale, out_dtype=torch.bfloat16
                        )
                        for w in w8
                    ]
                )
            except RuntimeError as e:  # noqa: PERF203
                print("rowwise:", str(e).splitlines()[0])
                rowwise = float("nan")
            bound = k * n / bandwidth * 1e6
            print(f"{name},{m},{k},{n},{bf16:.1f},{tensor:.1f},{rowwise:.1f},{bound:.1f}")
        del w16, w8


if __name__ == "__main__":
    main()
