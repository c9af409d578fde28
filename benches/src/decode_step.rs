//! The decode step without attention (24 layers of RMSNorm, qkv, o_proj, gate/up, SiLU·mul,
//! down; then norm and LM head), the same skeleton as `scripts/baselines/torch_decode_step.py`,
//! with our fused ops and with Burn's, eager and replayed as a CUDA graph; and with paged
//! attention (RoPE + KV write, decode attention over a 1,024-token context per row) in each
//! layer, replayed as a graph, twice: with the fused norm + linear ops, and through the model's
//! own layers (`model_qwen2::layers::Qwen2DecoderLayer`: norm gains folded into the weights, the
//! row scale deferred into the KV write and the gated activation, residual adds in o_proj and
//! down_proj) built from the same weights.

use burn::tensor::{DType, Device, Distribution, Tensor, activation::silu};
use cubecl_kernels::rms_norm_linear::reference;
use cubecl_kernels::{AttentionMetadata, LayerKvCache};
use model_qwen2::Qwen2Config;
use model_qwen2::layers::{
    Linear, Qwen2Attention, Qwen2DecoderLayer, Qwen2Mlp, RmsNorm, RotaryEmbedding,
};
use serde_json::json;

use crate::report::Report;
use crate::timing::{graph_us, median_us};

struct Layer {
    g1: Tensor<1>,
    wqkv: Tensor<2>,
    wo: Tensor<2>,
    g2: Tensor<1>,
    wgu: Tensor<2>,
    wd: Tensor<2>,
}

struct Weights {
    layers: Vec<Layer>,
    gf: Tensor<1>,
    head: Tensor<2>,
    inter: usize,
    /// Width of the attention output, `heads · head_dim` (the hidden size in Qwen2's configs,
    /// less in a rank's share under tensor parallelism).
    q_size: usize,
}

fn weights(c: &Qwen2Config, device: &Device, dtype: DType) -> Weights {
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let w =
        |s: [usize; 2]| Tensor::<2>::random(s, Distribution::Normal(0.0, 0.03), (device, dtype));
    let g = || Tensor::<1>::random([h], Distribution::Uniform(0.5, 1.5), (device, dtype));
    let qkv = c.q_size() + 2 * c.kv_size();
    let layers = (0..c.num_hidden_layers)
        .map(|_| Layer {
            g1: g(),
            wqkv: w([qkv, h]),
            wo: w([h, c.q_size()]),
            g2: g(),
            wgu: w([2 * i, h]),
            wd: w([h, i]),
        })
        .collect();
    Weights {
        layers,
        gf: g(),
        head: w([c.vocab_size, h]),
        inter: i,
        q_size: c.q_size(),
    }
}

impl Weights {
    /// The same weights in `dtype` (rounded once).
    fn cast(&self, dtype: DType) -> Self {
        let c2 = |t: &Tensor<2>| t.clone().cast(dtype);
        let c1 = |t: &Tensor<1>| t.clone().cast(dtype);
        Self {
            layers: self
                .layers
                .iter()
                .map(|l| Layer {
                    g1: c1(&l.g1),
                    wqkv: c2(&l.wqkv),
                    wo: c2(&l.wo),
                    g2: c1(&l.g2),
                    wgu: c2(&l.wgu),
                    wd: c2(&l.wd),
                })
                .collect(),
            gf: c1(&self.gf),
            head: c2(&self.head),
            inter: self.inter,
            q_size: self.q_size,
        }
    }

    /// The model's decoder layers over these weights (norm gains folded in as at load).
    fn model_layers(&self, c: &Qwen2Config) -> Vec<Qwen2DecoderLayer> {
        self.layers
            .iter()
            .map(|l| {
                Qwen2DecoderLayer {
                    input_layernorm: RmsNorm::new(l.g1.clone(), EPS),
                    self_attn: Qwen2Attention {
                        qkv_proj: Linear::new(l.wqkv.clone(), None),
                        o_proj: Linear::new(l.wo.clone(), None),
                        q_norm: None,
                        k_norm: None,
                        num_heads: c.num_attention_heads,
                        num_kv_heads: c.num_key_value_heads,
                        head_dim: c.head_dim,
                    },
                    post_attention_layernorm: RmsNorm::new(l.g2.clone(), EPS),
                    mlp: Qwen2Mlp {
                        gate_up_proj: Linear::new(l.wgu.clone(), None),
                        down_proj: Linear::new(l.wd.clone(), None),
                    },
                    parallel: None,
                }
                .fold_norm_gains()
            })
            .collect()
    }
}

/// RMSNorm epsilon of every norm of the step.
const EPS: f64 = 1e-6;

/// Context of every row in the step with attention.
const ATTENTION_CONTEXT: usize = 1024;

/// Paged attention of a decode step: one cache shared by the layers (each layer reads and
/// writes as many bytes as with its own), `rows` sequences of `ATTENTION_CONTEXT` tokens in
/// shuffled-free consecutive blocks, the model's RoPE tables.
struct Attention {
    cache: LayerKvCache,
    meta: AttentionMetadata,
    rotary: RotaryEmbedding,
    heads: usize,
    head_dim: usize,
}

impl Attention {
    fn new(c: &Qwen2Config, rows: usize, device: &Device, dtype: DType) -> Self {
        const BLOCK: usize = 16;
        let per_seq = ATTENTION_CONTEXT.div_ceil(BLOCK);
        let tables = (0..rows)
            .map(|r| ((r * per_seq) as u32..((r + 1) * per_seq) as u32).collect())
            .collect();
        let meta = AttentionMetadata::new(
            vec![1; rows],
            vec![ATTENTION_CONTEXT; rows],
            tables,
            BLOCK,
            device,
        )
        .expect("attention metadata");
        let shape = [rows * per_seq, c.num_key_value_heads, BLOCK, c.head_dim];
        let kv = || Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), (device, dtype));
        Self {
            cache: LayerKvCache::new(kv(), kv()),
            meta,
            rotary: RotaryEmbedding::new(c.head_dim, ATTENTION_CONTEXT + 1, c.rope_theta, device),
            heads: c.num_attention_heads,
            head_dim: c.head_dim,
        }
    }

    /// The same cache contents and metadata in `dtype` (the RoPE tables stay f32).
    fn cast(&self, dtype: DType) -> Self {
        Self {
            cache: LayerKvCache::new(
                self.cache.k.clone().cast(dtype),
                self.cache.v.clone().cast(dtype),
            ),
            meta: self.meta.clone(),
            rotary: self.rotary.clone(),
            heads: self.heads,
            head_dim: self.head_dim,
        }
    }

    /// `qkv [M, (heads + 2·kv_heads)·D]` → attention output `[M, heads·D]`.
    fn attend(&mut self, qkv: Tensor<2>) -> Tensor<2> {
        let m = qkv.dims()[0];
        let q = cubecl_kernels::rope_store_kv(
            qkv,
            self.heads,
            None,
            None,
            self.rotary.rope(),
            &self.meta,
            &mut self.cache,
        );
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        cubecl_kernels::paged_attention(q, &self.cache, &self.meta, scale)
            .reshape([m, self.heads * self.head_dim])
    }
}

/// Our ops: the residual add folded into the next fused norm + linear; with `attention`, each
/// layer's o_proj reads the attention output instead of the query slice of `qkv`.
fn step_ours(w: &Weights, x: &Tensor<2>, mut attention: Option<&mut Attention>) -> Tensor<2> {
    let i = w.inter;
    let mut out: Option<Tensor<2>> = None;
    let mut res = x.clone();
    for l in &w.layers {
        let (qkv, r) = match out.take() {
            Some(o) => {
                cubecl_kernels::add_rms_norm_linear(o, res, l.g1.clone(), l.wqkv.clone(), None, EPS)
            }
            None => (
                cubecl_kernels::rms_norm_linear(
                    res.clone(),
                    l.g1.clone(),
                    l.wqkv.clone(),
                    None,
                    EPS,
                ),
                res,
            ),
        };
        let attn = match attention.as_deref_mut() {
            Some(a) => a.attend(qkv),
            None => qkv.slice_dim(1, 0..w.q_size),
        };
        let o = cubecl_kernels::linear(attn, l.wo.clone(), None);
        let (gu, r) =
            cubecl_kernels::add_rms_norm_linear(o, r, l.g2.clone(), l.wgu.clone(), None, EPS);
        let act = silu(gu.clone().slice_dim(1, 0..i)) * gu.slice_dim(1, i..2 * i);
        out = Some(cubecl_kernels::linear(act, l.wd.clone(), None));
        res = r;
    }
    cubecl_kernels::add_rms_norm_linear(
        out.expect("layers"),
        res,
        w.gf.clone(),
        w.head.clone(),
        None,
        EPS,
    )
    .0
}

/// The model's own decoder layers with attention, then the final norm + LM head as the model
/// runs them.
fn step_model(
    layers: &[Qwen2DecoderLayer],
    w: &Weights,
    x: &Tensor<2>,
    attention: &mut Attention,
) -> Tensor<2> {
    let mut h = x.clone();
    for layer in layers {
        h = layer.forward(h, &attention.rotary, &attention.meta, &mut attention.cache);
    }
    cubecl_kernels::rms_norm_linear(h, w.gf.clone(), w.head.clone(), None, EPS)
}

/// Burn's own ops (the reference compositions), as in the PyTorch script.
fn step_burn(w: &Weights, x: &Tensor<2>) -> Tensor<2> {
    let i = w.inter;
    let mut x = x.clone();
    for l in &w.layers {
        let qkv = reference::rms_norm_linear(x.clone(), l.g1.clone(), l.wqkv.clone(), None, EPS);
        x = x + reference::linear(qkv.slice_dim(1, 0..w.q_size), l.wo.clone(), None);
        let gu = reference::rms_norm_linear(x.clone(), l.g2.clone(), l.wgu.clone(), None, EPS);
        let act = silu(gu.clone().slice_dim(1, 0..i)) * gu.slice_dim(1, i..2 * i);
        x = x + reference::linear(act, l.wd.clone(), None);
    }
    reference::rms_norm_linear(x, w.gf.clone(), w.head.clone(), None, EPS)
}

/// `with_burn = false` times only our ops, e.g. under a profiler: no Burn baseline and no f32
/// reference (its error columns are NaN; the f32 copy of a 32B model's weights would not fit).
pub fn run(
    model: &str,
    c: &Qwen2Config,
    ms: &[usize],
    with_burn: bool,
    device: &Device,
    dtype: DType,
) -> Report {
    let mut report = Report::new(
        &format!("decode step without attention {model} {dtype:?}"),
        &[
            "model",
            "M",
            "ours_eager_ms",
            "ours_graph_ms",
            "fused_graph_attn1k_ms",
            "ours_graph_attn1k_ms",
            "fused_attn_err_vs_f32",
            "ours_attn_err_vs_f32",
            "burn_eager_ms",
            "burn_graph_ms",
            "rel_err",
        ],
    );
    // Drawn in f32 and rounded: the f32 step with attention is the accuracy reference of both
    // steps with attention in `dtype`.
    let w32 = with_burn.then(|| weights(c, device, DType::F32));
    let w = match &w32 {
        Some(w32) => w32.cast(dtype),
        None => weights(c, device, dtype),
    };
    let layers = w.model_layers(c);
    for &m in ms {
        let x32 = Tensor::<2>::random(
            [m, c.hidden_size],
            Distribution::Normal(0.0, 1.0),
            (device, DType::F32),
        );
        let x = x32.clone().cast(dtype);
        let attention32 = Attention::new(c, m, device, DType::F32);
        let eager_ours = median_us(device, 5, 10, || step_ours(&w, &x, None)) / 1e3;
        let graph_ours = graph_us(device, 1, 10, || step_ours(&w, &x, None)) / 1e3;
        let mut attention = attention32.cast(dtype);
        let graph_fused = graph_us(device, 1, 10, || step_ours(&w, &x, Some(&mut attention))) / 1e3;
        let graph_attn = graph_us(device, 1, 10, || {
            step_model(&layers, &w, &x, &mut attention)
        }) / 1e3;
        let (fused_err, deferred_err) = match &w32 {
            Some(w32) => {
                // Every step writes the same keys and values into the same slots (each
                // rewrites them).
                let mut attention32 = attention32;
                let reference = step_ours(w32, &x32, Some(&mut attention32));
                let err_vs_f32 =
                    |y: Tensor<2>| crate::linear::rel_err(y.cast(DType::F32), reference.clone());
                (
                    err_vs_f32(step_ours(&w, &x, Some(&mut attention))),
                    err_vs_f32(step_model(&layers, &w, &x, &mut attention)),
                )
            }
            None => (f64::NAN, f64::NAN),
        };
        let (err, eager_burn, graph_burn) = if with_burn {
            (
                crate::linear::rel_err(step_ours(&w, &x, None), step_burn(&w, &x)),
                median_us(device, 5, 10, || step_burn(&w, &x)) / 1e3,
                graph_us(device, 1, 10, || step_burn(&w, &x)) / 1e3,
            )
        } else {
            (f64::NAN, f64::NAN, f64::NAN)
        };
        report.row(vec![
            json!(model),
            json!(m),
            json!(eager_ours),
            json!(graph_ours),
            json!(graph_fused),
            json!(graph_attn),
            json!(fused_err),
            json!(deferred_err),
            json!(eager_burn),
            json!(graph_burn),
            json!(err),
        ]);
    }
    report
}
