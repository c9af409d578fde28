//! Paged attention (prefill and decode) against the plain-Burn references; the batch layouts
//! and caches the KV-write tests share.

use burn::tensor::{DType, Device};
use cubecl_kernels::attention::reference;
use cubecl_kernels::{AttentionMetadata, LayerKvCache, ReductionOrder};
use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use super::common::*;

/// A batch layout: per sequence (new tokens, context), shuffled physical blocks.
pub(super) struct Layout {
    pub(super) query_lens: Vec<usize>,
    pub(super) context_lens: Vec<usize>,
    pub(super) tables: Vec<Vec<u32>>,
    pub(super) block_size: usize,
    pub(super) num_blocks: usize,
}

impl Layout {
    pub(super) fn new(rng: &mut StdRng, seqs: &[(usize, usize)], block_size: usize) -> Self {
        let need: usize = seqs.iter().map(|&(_, c)| c.div_ceil(block_size)).sum();
        let num_blocks = need + 3;
        let mut free: Vec<u32> = (0..num_blocks as u32).collect();
        free.shuffle(rng);
        let tables = seqs
            .iter()
            .map(|&(_, c)| free.split_off(free.len() - c.div_ceil(block_size)))
            .collect();
        Self {
            query_lens: seqs.iter().map(|s| s.0).collect(),
            context_lens: seqs.iter().map(|s| s.1).collect(),
            tables,
            block_size,
            num_blocks,
        }
    }

    /// The batch's metadata as a step in `order` builds it: batch-invariant steps make every
    /// sequence a prefill chunk, one-token ones too.
    pub(super) fn meta(&self, device: &Device, order: ReductionOrder) -> AttentionMetadata {
        let build = match order {
            ReductionOrder::BatchInvariant => AttentionMetadata::prefill_only,
            ReductionOrder::Fastest => AttentionMetadata::new,
        };
        build(
            self.query_lens.clone(),
            self.context_lens.clone(),
            self.tables.clone(),
            self.block_size,
            device,
        )
        .unwrap()
    }

    pub(super) fn tokens(&self) -> usize {
        self.query_lens.iter().sum()
    }
}

pub(super) struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub d: usize,
}

pub(super) fn cache(
    values: &(Vec<f32>, Vec<f32>),
    l: &Layout,
    h: &Heads,
    dtype: DType,
    device: &Device,
) -> LayerKvCache {
    let shape = [l.num_blocks, h.kv_heads, l.block_size, h.d];
    LayerKvCache::new(
        tensor(&values.0, shape, dtype, device),
        tensor(&values.1, shape, dtype, device),
    )
}

/// Attention of random queries over a random cache, kernel vs reference.
pub(super) fn check_attention(
    rng: &mut StdRng,
    seqs: &[(usize, usize)],
    block_size: usize,
    h: Heads,
    dtype: DType,
) {
    check_attention_ordered(rng, seqs, block_size, h, dtype, ReductionOrder::Fastest);
}

/// [`check_attention`] in `order`; batch-invariant: every sequence through the prefill kernel
/// (as batch-invariant steps send them).
fn check_attention_ordered(
    rng: &mut StdRng,
    seqs: &[(usize, usize)],
    block_size: usize,
    h: Heads,
    dtype: DType,
    order: ReductionOrder,
) {
    let l = Layout::new(rng, seqs, block_size);
    let what = format!(
        "{seqs:?} bs={block_size} heads={}/{} d={} {dtype:?} {order:?}",
        h.heads, h.kv_heads, h.d
    );
    eprintln!("{what}");
    let cache_len = l.num_blocks * block_size * h.kv_heads * h.d;
    let kv = (
        random(rng, cache_len, 1.0, dtype),
        random(rng, cache_len, 1.0, dtype),
    );
    let q = random(rng, l.tokens() * h.heads * h.d, 1.0, dtype);
    let scale = 1.0 / (h.d as f32).sqrt();
    let run = |device: &Device, dtype: DType, kernel: bool| {
        let cache = cache(&kv, &l, &h, dtype, device);
        let q = tensor(&q, [l.tokens(), h.heads, h.d], dtype, device);
        let meta = l.meta(device, order);
        if kernel {
            poison_pool(device, 4 * q.dims().iter().product::<usize>() + 4096);
            let out = cubecl_kernels::paged_attention_ordered(q, &cache, &meta, scale, order);
            host(out)
        } else {
            host(reference::paged_attention(q, &cache, &meta, scale))
        }
    };
    let out = run(&kernel_device(), dtype, true);
    let expected = run(&reference_device(), DType::F32, false);
    assert_rel(&what, &out, &expected, tolerance(dtype));
}

/// Ragged prefill: lengths 1, 2, 17, 255, 256, 257, 1000, some over cached prefixes.
#[test]
fn prefill_matches_reference() {
    let mut rng = rng("prefill_matches_reference");
    let seqs = [
        (1, 1),
        (2, 2),
        (17, 40),
        (255, 255),
        (256, 300),
        (257, 257),
        (1000, 1000),
    ];
    check_attention(
        &mut rng,
        &seqs,
        16,
        Heads {
            heads: 14,
            kv_heads: 2,
            d: 64,
        },
        DType::F32,
    );
    check_attention(
        &mut rng,
        &seqs[..6],
        256,
        Heads {
            heads: 8,
            kv_heads: 1,
            d: 128,
        },
        DType::BF16,
    );
    // Qwen2-0.5B's group of 7 in bf16 (on CUDA: one cube of 7 planes shares each K/V stage).
    check_attention(
        &mut rng,
        &[(1, 1), (17, 40), (255, 255)],
        16,
        Heads {
            heads: 14,
            kv_heads: 2,
            d: 64,
        },
        DType::BF16,
    );
    check_attention(
        &mut rng,
        &[(3, 3), (17, 17), (1, 18)],
        16,
        Heads {
            heads: 2,
            kv_heads: 2,
            d: 64,
        },
        DType::F16,
    );
    check_attention(
        &mut rng,
        &[(40, 100), (5, 5)],
        16,
        Heads {
            heads: 4,
            kv_heads: 2,
            d: 128,
        },
        DType::F32,
    );
    // Qwen3's group of 2 in bf16 (on CUDA: both heads in one cube of 8 planes), chunks over
    // prefixes that end inside a query tile and a K/V stage, and an empty prefix of a tile's
    // length.
    check_attention(
        &mut rng,
        &[(100, 137), (64, 64), (65, 200), (31, 95)],
        16,
        Heads {
            heads: 4,
            kv_heads: 2,
            d: 128,
        },
        DType::BF16,
    );
}

/// Batch-invariant steps' prefill tiles (on CUDA shaped for one query row: the group's heads
/// packed into each plane's rows for groups of 3 to 16, one block a head below), one-token
/// sequences among ragged chunks over prefixes, against the reference.
#[test]
fn batch_invariant_prefill_matches_reference() {
    let mut rng = rng("batch_invariant_prefill_matches_reference");
    let seqs = [
        (1, 1),
        (1, 40),
        (1, 300),
        (17, 40),
        (2, 2),
        (255, 300),
        (33, 33),
    ];
    for (heads, kv_heads, d) in [
        (14, 2, 64),
        (28, 4, 128),
        (16, 8, 128),
        (8, 1, 128),
        (16, 1, 64),
    ] {
        check_attention_ordered(
            &mut rng,
            &seqs,
            16,
            Heads { heads, kv_heads, d },
            DType::BF16,
            ReductionOrder::BatchInvariant,
        );
    }
}

/// The prefill tile list covers every query of every sequence once, in tiles of `rows`, and
/// deals the tiles heaviest first (keys the tile's last row attends to), across sequences.
#[test]
fn prefill_tiles_cover_each_query_once_heaviest_first() {
    let lens = [(5, 5), (130, 200), (64, 64), (1, 300), (16, 40)];
    let rows = 16;
    let tiles = cubecl_kernels::prefill_tiles(&lens, rows);
    let keys = |[s, q0]: [i32; 2]| {
        let (q_len, ctx) = lens[s as usize];
        ctx - q_len + (q0 as usize + rows).min(q_len)
    };
    let mut covered: Vec<Vec<usize>> = lens.iter().map(|&(q, _)| vec![0; q]).collect();
    for &[s, q0] in &tiles {
        let (s, q0) = (s as usize, q0 as usize);
        let q_end = (q0 + rows).min(lens[s].0);
        covered[s][q0..q_end].iter_mut().for_each(|n| *n += 1);
    }
    assert!(covered.iter().flatten().all(|&n| n == 1), "{tiles:?}");
    assert_eq!(tiles.len(), 1 + 9 + 4 + 1 + 1);
    let work: Vec<usize> = tiles.iter().map(|&t| keys(t)).collect();
    assert!(work.windows(2).all(|w| w[0] >= w[1]), "{work:?}");
    // The one-token chunk over a 300-token context outweighs all but the longest tiles.
    assert_eq!(tiles[0], [3, 0]);
    assert_eq!(tiles[1], [1, 128]);
}

/// Decode of a batch that fills the device alone (150 sequences: on the H100 above half the
/// tensor-core kernel's target cubes, on CPU runtimes far above), short contexts among a few
/// long ones, each sequence written by its one cube.
#[test]
fn decode_of_a_full_batch_matches_reference() {
    let mut rng = rng("decode_of_a_full_batch_matches_reference");
    let mut seqs: Vec<(usize, usize)> = (0..150).map(|_| (1, rng.random_range(1..300))).collect();
    for (i, ctx) in [1025, 2500, 4097, 1024].into_iter().enumerate() {
        seqs[i * 37] = (1, ctx);
    }
    check_attention(
        &mut rng,
        &seqs,
        16,
        Heads {
            heads: 14,
            kv_heads: 2,
            d: 64,
        },
        DType::BF16,
    );
    check_attention(
        &mut rng,
        &seqs,
        16,
        Heads {
            heads: 16,
            kv_heads: 8,
            d: 128,
        },
        DType::F32,
    );
}

/// Decode: one token per sequence over contexts 1 … 1000; small batches split each context
/// into as many pieces as it has (a piece count per sequence), batch 1 into the most.
#[test]
fn decode_matches_reference() {
    let mut rng = rng("decode_matches_reference");
    let ctx = [1, 2, 17, 255, 256, 257, 1000];
    let seqs: Vec<(usize, usize)> = ctx.iter().map(|&c| (1, c)).collect();
    check_attention(
        &mut rng,
        &seqs,
        16,
        Heads {
            heads: 14,
            kv_heads: 2,
            d: 64,
        },
        DType::F32,
    );
    check_attention(
        &mut rng,
        &seqs,
        256,
        Heads {
            heads: 8,
            kv_heads: 8,
            d: 128,
        },
        DType::BF16,
    );
    check_attention(
        &mut rng,
        &[(1, 1000)],
        16,
        Heads {
            heads: 8,
            kv_heads: 1,
            d: 128,
        },
        DType::F32,
    );
    // Wide groups in half precision (on CUDA: the tensor-core decode kernel, heads as rows).
    check_attention(
        &mut rng,
        &seqs,
        16,
        Heads {
            heads: 14,
            kv_heads: 2,
            d: 64,
        },
        DType::BF16,
    );
    check_attention(
        &mut rng,
        &[(1, 3), (1, 1000)],
        256,
        Heads {
            heads: 16,
            kv_heads: 2,
            d: 128,
        },
        DType::F16,
    );
    // A block size that is not a multiple of the row-split kernel's key tile (lookups per key).
    check_attention(
        &mut rng,
        &[(1, 5), (1, 300)],
        20,
        Heads {
            heads: 4,
            kv_heads: 2,
            d: 64,
        },
        DType::F32,
    );
    check_attention(
        &mut rng,
        &[(1, 777)],
        256,
        Heads {
            heads: 4,
            kv_heads: 2,
            d: 64,
        },
        DType::F16,
    );
}
