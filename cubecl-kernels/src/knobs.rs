//! Environment knobs for benchmarks: alternative launch layouts and forced kernel paths, so that
//! one binary measures its variants in one device command. All of them are read once, here,
//! into [`Knobs`]; the launchers read the struct.

use std::sync::OnceLock;

/// Every benchmark knob of the kernels, as set in the environment at first use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Knobs {
    /// `BURN_NANOVLLM_SKINNY_MAX_M=m`: the skinny linear kernel up to `m` rows, whatever the
    /// weight size.
    pub skinny_max_m: Option<usize>,
    /// `BURN_NANOVLLM_SPLIT_K=0`: no K split in the cubek linear path.
    pub split_k_off: bool,
    /// `BURN_NANOVLLM_CUBLAS=0`: the portable linear paths even where cuBLASLt is present.
    pub cublas_off: bool,
    /// `BURN_NANOVLLM_CUBLAS=fenced`: cuBLASLt on its own stream, fenced by the context and kept
    /// out of graph captures, as a build against the published cubecl-cuda runs it, even where
    /// CubeCL's stream is known (measures what a dependent without the `[patch]` gets).
    pub cublas_fenced: bool,
    /// `BURN_NANOVLLM_CUBLAS_TUNE=rows`: cuBLASLt's candidates are timed for shapes of at least
    /// `rows` rows (`off`: never).
    pub cublas_tune_min_rows: Option<usize>,
    /// `BURN_NANOVLLM_PREFILL_FMA` set: the FMA prefill kernel even where tensor cores exist.
    pub prefill_fma: bool,
    /// `BURN_NANOVLLM_PREFILL_CMMA` set: the portable-cmma prefill kernel even where manual MMA
    /// exists.
    pub prefill_cmma: bool,
    /// `BURN_NANOVLLM_PREFILL_TILE=planes,block_k`: the cmma prefill tile.
    pub prefill_tile: Option<(usize, usize)>,
    /// `BURN_NANOVLLM_PREFILL_MMA=heads_per_cube,row_blocks,block_k`: the manual-MMA prefill
    /// layout.
    pub prefill_mma: Option<(usize, usize, usize)>,
    /// `BURN_NANOVLLM_PREFILL_PACKED=0|1`: whether the manual-MMA prefill tile packs its heads
    /// into each plane's rows.
    pub prefill_packed: Option<bool>,
    /// `BURN_NANOVLLM_DECODE=lanes,heads_per_unit,tile`: the decode unit layout on plane
    /// devices.
    pub decode_layout: Option<(usize, usize, usize)>,
    /// `BURN_NANOVLLM_DECODE_UNITS=units`: units per cube the row-split decode kernel aims at
    /// (its key streams fill them).
    pub decode_units: Option<usize>,
    /// `BURN_NANOVLLM_DECODE_MMA=planes`: planes of the tensor-core decode kernel (0: never it).
    pub decode_mma_planes: Option<usize>,
    /// `BURN_NANOVLLM_DECODE_SPLIT_KEYS=keys`: a batch that fills the device alone splits its
    /// contexts into pieces of at least `keys` keys (default, and 0: it does not split).
    pub decode_split_keys: Option<usize>,
    /// `BURN_NANOVLLM_SAMPLE_UNITS=units`: units per cube (per row) of the sampler on plane
    /// devices (a power of two, at most the device's cube size).
    pub sample_units: Option<usize>,
    /// `BURN_NANOVLLM_SAMPLE_FILL=cubes`: cubes per multiprocessor the sampler's row splits
    /// aim for (0: one cube per row).
    pub sample_fill: Option<usize>,
    /// `BURN_NANOVLLM_ALL_REDUCE=nccl`: tensor parallelism's sums through NCCL at every size
    /// (no IPC kernels).
    pub all_reduce_nccl_only: bool,
    /// `BURN_NANOVLLM_ALL_REDUCE=pull`: the IPC kernels read their peers' buffers instead of
    /// writing their data into them.
    pub all_reduce_pull: bool,
    /// `BURN_NANOVLLM_ALL_REDUCE_ONE_SHOT_MAX=bytes`: the one-shot IPC kernel up to `bytes` at
    /// 3 ranks or more (default 512 KiB; the two-shot kernel beyond).
    pub all_reduce_one_shot_max: Option<usize>,
    /// `BURN_NANOVLLM_INVARIANT_SPLIT_K=1`: batch-invariant cuBLASLt plans may split K (the
    /// reference shape's pick with its split count and a separate reduction of the parts, kept
    /// for every M; never the in-place reduction), instead of no split.
    pub invariant_split_k: bool,
    /// `BURN_NANOVLLM_SOFTMAX_EXP=exact`: the tensor-core attention kernels' softmax takes
    /// libdevice's `expf` even where PTX's `ex2.approx` lowers.
    pub softmax_exact_exp: bool,
    /// `BURN_NANOVLLM_SOFTMAX_MASK=all`: the tensor-core attention kernels mask every stage, not
    /// only those that reach past a row's causal limit.
    pub softmax_mask_all: bool,
    /// `BURN_NANOVLLM_FP8_DECODE=bits`: the FP8 cache's attention kernels and the FP8 weights'
    /// one-row product decode codes by bit placement even where PTX's paired conversion lowers.
    pub fp8_decode_bits: bool,
    /// `BURN_NANOVLLM_FP8_DECODE=bf16-stage`: the tensor-core decode kernel stages PTX-decoded
    /// FP8 codes as the activations' dtype (bf16) instead of as f16 halves (for A/B runs).
    pub fp8_stage_bf16: bool,
    /// `BURN_NANOVLLM_FP8_SCALES=row`: FP8 weights quantised at load take one scale per output
    /// feature (and their products per-row activation scales) instead of one per tensor.
    pub fp8_scales_per_row: bool,
    /// `BURN_NANOVLLM_ALL_REDUCE_BLOCKS=cubes`: cubes of the IPC kernels at most (default: one
    /// per multiprocessor, at most 128).
    pub all_reduce_blocks: Option<usize>,
}

impl Knobs {
    /// The knobs of this process (read from the environment on the first call).
    pub(crate) fn get() -> &'static Knobs {
        static KNOBS: OnceLock<Knobs> = OnceLock::new();
        KNOBS.get_or_init(Self::from_env)
    }

    fn from_env() -> Self {
        let cublas = std::env::var("BURN_NANOVLLM_CUBLAS").ok();
        let all_reduce = std::env::var("BURN_NANOVLLM_ALL_REDUCE").ok();
        Self {
            skinny_max_m: numbers("BURN_NANOVLLM_SKINNY_MAX_M").map(|[m]| m),
            split_k_off: std::env::var("BURN_NANOVLLM_SPLIT_K").is_ok_and(|v| v == "0"),
            cublas_off: cublas.as_deref() == Some("0"),
            cublas_fenced: cublas.as_deref() == Some("fenced"),
            cublas_tune_min_rows: match std::env::var("BURN_NANOVLLM_CUBLAS_TUNE").as_deref() {
                Ok("off") => Some(usize::MAX),
                _ => numbers("BURN_NANOVLLM_CUBLAS_TUNE").map(|[r]| r),
            },
            prefill_fma: is_set("BURN_NANOVLLM_PREFILL_FMA"),
            prefill_cmma: is_set("BURN_NANOVLLM_PREFILL_CMMA"),
            prefill_tile: numbers("BURN_NANOVLLM_PREFILL_TILE").map(|[p, k]| (p, k)),
            prefill_mma: numbers("BURN_NANOVLLM_PREFILL_MMA").map(|[h, r, k]| (h, r, k)),
            prefill_packed: numbers("BURN_NANOVLLM_PREFILL_PACKED").map(|[p]| p != 0),
            decode_layout: numbers("BURN_NANOVLLM_DECODE").map(|[l, h, t]| (l, h, t)),
            decode_units: numbers("BURN_NANOVLLM_DECODE_UNITS").map(|[u]| u),
            decode_mma_planes: numbers("BURN_NANOVLLM_DECODE_MMA").map(|[p]| p),
            decode_split_keys: numbers("BURN_NANOVLLM_DECODE_SPLIT_KEYS").map(|[k]| k),
            sample_units: numbers("BURN_NANOVLLM_SAMPLE_UNITS").map(|[u]| u),
            sample_fill: numbers("BURN_NANOVLLM_SAMPLE_FILL").map(|[c]| c),
            all_reduce_nccl_only: all_reduce.as_deref() == Some("nccl"),
            all_reduce_pull: all_reduce.as_deref() == Some("pull"),
            all_reduce_one_shot_max: numbers("BURN_NANOVLLM_ALL_REDUCE_ONE_SHOT_MAX").map(|[b]| b),
            invariant_split_k: std::env::var("BURN_NANOVLLM_INVARIANT_SPLIT_K")
                .is_ok_and(|v| v == "1"),
            softmax_exact_exp: std::env::var("BURN_NANOVLLM_SOFTMAX_EXP")
                .is_ok_and(|v| v == "exact"),
            softmax_mask_all: std::env::var("BURN_NANOVLLM_SOFTMAX_MASK").is_ok_and(|v| v == "all"),
            fp8_decode_bits: std::env::var("BURN_NANOVLLM_FP8_DECODE").is_ok_and(|v| v == "bits"),
            fp8_stage_bf16: std::env::var("BURN_NANOVLLM_FP8_DECODE")
                .is_ok_and(|v| v == "bf16-stage"),
            fp8_scales_per_row: std::env::var("BURN_NANOVLLM_FP8_SCALES").is_ok_and(|v| v == "row"),
            all_reduce_blocks: numbers("BURN_NANOVLLM_ALL_REDUCE_BLOCKS").map(|[c]| c),
        }
    }
}

/// True if `name` is set (to anything).
fn is_set(name: &str) -> bool {
    std::env::var_os(name).is_some()
}

/// `name=a,b,…` with exactly `N` unsigned integers, else `None`.
fn numbers<const N: usize>(name: &str) -> Option<[usize; N]> {
    let text = std::env::var(name).ok()?;
    let values: Vec<usize> = text
        .split(',')
        .map(|x| x.trim().parse().ok())
        .collect::<Option<_>>()?;
    values.try_into().ok()
}
