//! Runs [`hopper_prefill::prefill_wgmma`] on CUDA device 0: causal attention of random bf16
//! Q, K, V against a host reference (f64 sums), then times it.
//!
//! `hopper-prefill [HEADS SEQ D [GROUP [ITERS]]]` (default 14 4096 64 7 20: Qwen2-0.5B's heads;
//! several sequences are more heads, `GROUP` query heads a kv head). Prints the largest error
//! against the reference over the checked rows and the kernel's TFLOP/s (causal: `2·heads·D·seq²`
//! multiply-adds counted as FLOPs, as FlashAttention counts them).

use std::time::Instant;

use cubecl::prelude::*;
use cubecl::zspace::Shape;
use cubecl_runtime::runtime::Runtime;
use hopper_prefill::{PANEL, QUERIES, UNITS, k_major, prefill_wgmma, prefill_wgmma_tma};

type Bf16 = half::bf16;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| {
            a.parse()
                .expect("arguments are numbers: HEADS SEQ D [ITERS]")
        })
        .collect();
    let (heads, seq, d) = match args[..] {
        [h, s, d, ..] => (h, s, d),
        _ => (14, 4096, 64),
    };
    let group = args
        .get(3)
        .copied()
        .unwrap_or(if args.is_empty() { 7 } else { 1 });
    let iters = args.get(4).copied().unwrap_or(20);
    assert!(d == 64 || d == 128, "D is 64 or 128");
    assert!(group > 0 && heads % group == 0, "GROUP divides HEADS");
    let client = cubecl::cuda::CudaRuntime::client(&Default::default());

    // A small deterministic generator: values in [-1, 1).
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut random = |n: usize| -> Vec<Bf16> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                Bf16::from_f32((state >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            })
            .collect()
    };
    let n = heads * seq * d;
    let kv_n = n / group;
    let (q, k, v) = (random(n), random(kv_n), random(kv_n));
    let out = client.create_from_slice(f32::as_bytes(&vec![0.0f32; n]));
    let scale = 1.0 / (d as f32).sqrt();
    // libdevice's `expf` unless HOPPER_PREFILL_EXP=poly.
    let libdevice = std::env::var("HOPPER_PREFILL_EXP").map_or(true, |v| v != "poly");
    // P from registers unless HOPPER_PREFILL_P=shared.
    let p_shared = std::env::var("HOPPER_PREFILL_P").is_ok_and(|v| v == "shared");
    // Tiles staged by the units unless HOPPER_PREFILL_LOAD=tma.
    let tma = std::env::var("HOPPER_PREFILL_LOAD").is_ok_and(|v| v == "tma");
    // Q, K and V uploaded once, as the loader reads them: plain buffers for the units, or
    // `[rows, D]` tensors with a tensor map over each at every launch (boxes of 64 rows × one
    // 128-byte panel, swizzled as the tiles are).
    let upload = |x: &[Bf16]| client.create_from_slice(Bf16::as_bytes(x));
    let buffers = (!tma).then(|| [upload(&q), upload(&k), upload(&v)]);
    let tensor = |x: &[Bf16], rows: usize| {
        let shape: Shape = [rows, d].into();
        let layout = client.create_tensor_from_slice(Bf16::as_bytes(x), shape.clone(), 2);
        (layout.memory, layout.strides, shape)
    };
    let tensors = tma.then(|| {
        [
            tensor(&q, heads * seq),
            tensor(&k, heads / group * seq),
            tensor(&v, heads / group * seq),
        ]
    });
    let map = |(memory, strides, shape): &(_, _, Shape)| {
        let tensor = unsafe {
            TensorArg::from_raw_parts(Clone::clone(memory), Clone::clone(strides), shape.clone())
        };
        TensorMapArg::new(
            TiledArgs {
                tile_size: [QUERIES, PANEL].into(),
            },
            tensor,
            Bf16::elem_type_native(),
        )
        .with_swizzle(k_major(QUERIES, d).tensor_map_swizzle())
    };
    let count = CubeCount::Static(seq.div_ceil(QUERIES) as u32, heads as u32, 1);
    let launch = || unsafe {
        if let Some([qt, kt, vt]) = &tensors {
            prefill_wgmma_tma::launch_unchecked::<Bf16>(
                &client,
                count.clone(),
                CubeDim::new_1d(UNITS as u32),
                map(qt),
                map(kt),
                map(vt),
                BufferArg::from_raw_parts(out.clone(), n),
                seq,
                group,
                scale,
                d,
                libdevice,
                p_shared,
            )
        } else if let Some([qh, kh, vh]) = &buffers {
            prefill_wgmma::launch_unchecked::<Bf16>(
                &client,
                count.clone(),
                CubeDim::new_1d(UNITS as u32),
                BufferArg::from_raw_parts(qh.clone(), n),
                BufferArg::from_raw_parts(kh.clone(), kv_n),
                BufferArg::from_raw_parts(vh.clone(), kv_n),
                BufferArg::from_raw_parts(out.clone(), n),
                seq,
                group,
                scale,
                d,
                libdevice,
                p_shared,
            )
        }
    };
    launch();
    let got = f32::from_bytes(&client.read_one_unchecked(out.clone())).to_vec();

    // The reference over some rows of every head: the first 130, then every 97th.
    let f = |x: &[Bf16], i: usize| x[i].to_f32() as f64;
    let mut worst = 0.0f64;
    for h in 0..heads {
        for row in (0..seq).filter(|&r| r < 130 || r % 97 == 0) {
            let qi = (h * seq + row) * d;
            let scores: Vec<f64> = (0..=row)
                .map(|key| {
                    let ki = (h / group * seq + key) * d;
                    (0..d).map(|c| f(&q, qi + c) * f(&k, ki + c)).sum::<f64>() * scale as f64
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::MIN, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let total: f64 = w.iter().sum();
            for c in 0..d {
                let want: f64 = (0..=row)
                    .map(|key| w[key] * f(&v, (h / group * seq + key) * d + c))
                    .sum::<f64>()
                    / total;
                worst = worst.max((got[qi + c] as f64 - want).abs());
            }
        }
    }
    println!(
        "heads {heads} seq {seq} D {d} group {group} (exp: {}, P: {}, loads: {}): largest error \
         against the reference {worst:.3e}",
        if libdevice { "libdevice" } else { "polynomial" },
        if p_shared { "shared" } else { "registers" },
        if tma { "TMA" } else { "units" }
    );

    let sync = || cubecl::future::block_on(client.sync()).expect("sync");
    sync();
    let start = Instant::now();
    for _ in 0..iters {
        launch();
    }
    sync();
    let seconds = start.elapsed().as_secs_f64() / iters as f64;
    let flops = 2.0 * heads as f64 * d as f64 * (seq as f64) * (seq as f64);
    println!(
        "{:.1} us a launch, {:.1} TFLOP/s (causal)",
        seconds * 1e6,
        flops / seconds / 1e12
    );
}
