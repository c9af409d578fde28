//! The Qwen2 / Qwen2.5 / Qwen3 causal language model as a Burn module.

use std::ops::Range;
use std::path::Path;

use burn::module::{Module, Param};
use burn::tensor::{DType, Device, Distribution, FloatDType, Int, Tensor, TensorData};
use cubecl_kernels::{AttentionMetadata, ReductionOrder};

use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};
use crate::kv_cache::{KvCache, KvScales};
use crate::layers::{
    Linear, Qwen2Attention, Qwen2DecoderLayer, Qwen2Mlp, RmsNorm, RotaryEmbedding,
};
use crate::tensor_parallel::{Parallel, TpRank};
use crate::weights::Checkpoint;

/// Which rows of the flattened batch get logits.
#[derive(Clone, Debug)]
pub enum LogitsRows {
    /// Every token (`[num_tokens, V]`): scoring prompts, tests, decode steps.
    All,
    /// The last token of each sequence (`[B, V]`): generation.
    LastPerSequence,
    /// The given token rows (`[n]` i32 indices into the flattened batch → `[n, V]`): the rows
    /// an engine step samples.
    Rows(Box<Tensor<1, Int>>),
}

/// Qwen2-family decoder-only transformer with its LM head.
///
/// The forward pass takes a flattened batch of several sequences (`input_ids [num_tokens]`) and
/// an [`AttentionMetadata`] saying which tokens belong to which sequence and where each
/// sequence's keys and values live in the paged [`KvCache`].
#[derive(Module, Debug)]
pub struct Qwen2Model {
    /// Token embedding, `[V, H]` (under tensor parallelism this rank's rows, [`Self::vocab`]).
    pub embed_tokens: Param<Tensor<2>>,
    /// Decoder layers.
    pub layers: Vec<Qwen2DecoderLayer>,
    /// Final RMSNorm, `[H]`.
    pub norm: RmsNorm,
    /// LM head, `[V, H]` (this rank's rows under tensor parallelism); shares `embed_tokens`'
    /// buffer when the embeddings are tied.
    pub lm_head: Linear,
    /// RoPE tables.
    pub rotary: RotaryEmbedding,
    /// The configuration the model was built from.
    #[module(skip)]
    pub config: Qwen2Config,
    /// The tokens of this rank's embedding and LM head rows (the whole vocabulary on one
    /// device, and under tensor parallelism unless [`Parallel::vocab_parallel`]).
    #[module(skip)]
    pub vocab: Range<usize>,
    /// FP8 KV-cache scales the checkpoint carries (`self_attn.k_scale` and `v_scale` of every
    /// layer, or `kv_scale` for both, as vLLM and llm-compressor export them: one per layer,
    /// given here to each of this rank's kv heads); `None` without them.
    #[module(skip)]
    pub checkpoint_kv_scales: Option<KvScales>,
}

impl Qwen2Model {
    /// Loads a Hugging Face checkpoint folder (`config.json` + safetensors) in `dtype`.
    pub fn from_pretrained(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let config = Qwen2Config::from_file(dir.join("config.json"))?;
        let mut ckpt = Checkpoint::open(dir)?;
        let model = Self::from_checkpoint(config, &mut ckpt, dtype, device)?;
        ckpt.finish()?;
        Ok(model)
    }

    /// Builds the model from an opened checkpoint, reading every tensor the config implies.
    /// The weights go to persistent memory ([`cubecl_kernels::persistent`]).
    pub fn from_checkpoint(
        config: Qwen2Config,
        ckpt: &mut Checkpoint,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::from_checkpoint_part(config, ckpt, None, dtype, device)
    }

    /// [`Self::from_checkpoint`] of one tensor-parallel rank (`parallel`: its place and its
    /// collective; `None`: the whole model): the rank's shares of the layers' products (see
    /// [`crate::tensor_parallel`]), read from the checkpoint as slices, and a
    /// [`Self::config`] of its own heads and intermediate width.
    pub fn from_checkpoint_part(
        config: Qwen2Config,
        ckpt: &mut Checkpoint,
        parallel: Option<Parallel>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        cubecl_kernels::persistent(
            device,
            (config, ckpt, parallel),
            |(config, ckpt, parallel)| Self::read_checkpoint(config, ckpt, parallel, dtype, device),
        )
    }

    fn read_checkpoint(
        config: Qwen2Config,
        ckpt: &mut Checkpoint,
        parallel: Option<Parallel>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let c = &config;
        let (h, i, d) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let (q, kv) = (c.q_size(), c.kv_size());
        let (tp, vocab) = rank_share(parallel.as_ref(), c)?;
        let heads = tp.heads(c);
        let q_rows = heads.start * d..heads.end * d;
        let kv_heads = tp.kv_heads(c);
        let kv_rows = kv_heads.start * d..kv_heads.end * d;
        let inner = tp.intermediate(c);
        let local = tp.local_config(c);
        let embed = ckpt.tensor_part(
            "model.embed_tokens.weight",
            [c.vocab_size, h],
            (0, vocab.clone()),
            dtype,
            device,
        )?;
        let norm = |ckpt: &mut Checkpoint, name: &str, dim: usize| -> Result<RmsNorm> {
            Ok(RmsNorm::new(
                ckpt.tensor(name, [dim], dtype, device)?,
                c.rms_norm_eps,
            ))
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let attn = format!("{p}.self_attn");
            let qkv_w = ckpt.concat_parts(
                &[
                    (&format!("{attn}.q_proj.weight"), [q, h], q_rows.clone()),
                    (&format!("{attn}.k_proj.weight"), [kv, h], kv_rows.clone()),
                    (&format!("{attn}.v_proj.weight"), [kv, h], kv_rows.clone()),
                ],
                dtype,
                device,
            )?;
            let qkv_b = if c.attention_bias {
                Some(ckpt.concat_parts(
                    &[
                        (&format!("{attn}.q_proj.bias"), [q], q_rows.clone()),
                        (&format!("{attn}.k_proj.bias"), [kv], kv_rows.clone()),
                        (&format!("{attn}.v_proj.bias"), [kv], kv_rows.clone()),
                    ],
                    dtype,
                    device,
                )?)
            } else {
                None
            };
            let (q_norm, k_norm) = if c.qk_norm {
                (
                    Some(norm(ckpt, &format!("{attn}.q_norm.weight"), d)?),
                    Some(norm(ckpt, &format!("{attn}.k_norm.weight"), d)?),
                )
            } else {
                (None, None)
            };
            let o_proj = ckpt.tensor_part(
                &format!("{attn}.o_proj.weight"),
                [h, q],
                (1, q_rows.clone()),
                dtype,
                device,
            )?;
            let gate_up = ckpt.concat_parts(
                &[
                    (&format!("{p}.mlp.gate_proj.weight"), [i, h], inner.clone()),
                    (&format!("{p}.mlp.up_proj.weight"), [i, h], inner.clone()),
                ],
                dtype,
                device,
            )?;
            let down = ckpt.tensor_part(
                &format!("{p}.mlp.down_proj.weight"),
                [h, i],
                (1, inner.clone()),
                dtype,
                device,
            )?;
            // Older exports carry RoPE buffers; they are recomputed, never read.
            let _ = ckpt.raw(&format!("{attn}.rotary_emb.inv_freq"), &[d / 2]);
            layers.push(
                Qwen2DecoderLayer {
                    input_layernorm: norm(ckpt, &format!("{p}.input_layernorm.weight"), h)?,
                    self_attn: Qwen2Attention {
                        qkv_proj: Linear::new(qkv_w, qkv_b),
                        o_proj: Linear::new(o_proj, None),
                        q_norm,
                        k_norm,
                        num_heads: local.num_attention_heads,
                        num_kv_heads: local.num_key_value_heads,
                        head_dim: d,
                    },
                    post_attention_layernorm: norm(
                        ckpt,
                        &format!("{p}.post_attention_layernorm.weight"),
                        h,
                    )?,
                    mlp: Qwen2Mlp {
                        gate_up_proj: Linear::new(gate_up, None),
                        down_proj: Linear::new(down, None),
                    },
                    parallel: parallel.clone(),
                }
                .fold_norm_gains(),
            );
        }
        let scales = read_kv_scales(ckpt, c.num_hidden_layers, local.num_key_value_heads)?;
        let final_norm = norm(ckpt, "model.norm.weight", h)?;
        let lm_head = if c.tie_word_embeddings {
            // Some exports store the tied head anyway; the embedding is what the model uses.
            let _ = ckpt.raw("lm_head.weight", &[c.vocab_size, h]);
            embed.clone()
        } else {
            ckpt.tensor_part(
                "lm_head.weight",
                [c.vocab_size, h],
                (0, vocab.clone()),
                dtype,
                device,
            )?
        };
        let mut model = Self::assemble(local, vocab, embed, layers, final_norm, lm_head, device);
        model.checkpoint_kv_scales = scales;
        Ok(model)
    }

    /// Random weights for any config (like vLLM's `load_format=dummy`): real shapes without a
    /// download, for benchmarks. Linear weights ~ N(0, 0.02), norms 1; in persistent memory
    /// ([`cubecl_kernels::persistent`]).
    pub fn dummy(config: Qwen2Config, dtype: DType, device: &Device) -> Self {
        cubecl_kernels::persistent(device, config, |config| {
            let vocab = 0..config.vocab_size;
            Self::random_weights(config, vocab, None, dtype, device)
        })
    }

    /// [`Self::dummy`] of one tensor-parallel rank (`parallel`): random weights of its share's
    /// shapes (each rank draws its own), [`Self::config`] its own heads and intermediate width.
    pub fn dummy_part(
        config: Qwen2Config,
        parallel: Option<Parallel>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let (tp, vocab) = rank_share(parallel.as_ref(), &config)?;
        let local = tp.local_config(&config);
        Ok(cubecl_kernels::persistent(
            device,
            (local, vocab, parallel),
            |(local, vocab, parallel)| Self::random_weights(local, vocab, parallel, dtype, device),
        ))
    }

    fn random_weights(
        config: Qwen2Config,
        vocab: Range<usize>,
        parallel: Option<Parallel>,
        dtype: DType,
        device: &Device,
    ) -> Self {
        let c = &config;
        let (h, i, d) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let qkv_rows = c.q_size() + 2 * c.kv_size();
        let normal = |shape: [usize; 2]| {
            Tensor::<2>::random(shape, Distribution::Normal(0.0, 0.02), (device, dtype))
        };
        let ones = |dim: usize| RmsNorm::new(Tensor::ones([dim], (device, dtype)), c.rms_norm_eps);
        let layers = (0..c.num_hidden_layers)
            .map(|_| Qwen2DecoderLayer {
                input_layernorm: ones(h),
                self_attn: Qwen2Attention {
                    qkv_proj: Linear::new(
                        normal([qkv_rows, h]),
                        c.attention_bias.then(|| {
                            Tensor::random(
                                [qkv_rows],
                                Distribution::Normal(0.0, 0.02),
                                (device, dtype),
                            )
                        }),
                    ),
                    o_proj: Linear::new(normal([h, c.q_size()]), None),
                    q_norm: c.qk_norm.then(|| ones(d)),
                    k_norm: c.qk_norm.then(|| ones(d)),
                    num_heads: c.num_attention_heads,
                    num_kv_heads: c.num_key_value_heads,
                    head_dim: d,
                },
                post_attention_layernorm: ones(h),
                mlp: Qwen2Mlp {
                    gate_up_proj: Linear::new(normal([2 * i, h]), None),
                    down_proj: Linear::new(normal([h, i]), None),
                },
                parallel: parallel.clone(),
            })
            .map(Qwen2DecoderLayer::fold_norm_gains)
            .collect();
        let embed = normal([vocab.len(), h]);
        let lm_head = if c.tie_word_embeddings {
            embed.clone()
        } else {
            normal([vocab.len(), h])
        };
        let final_norm = ones(h);
        Self::assemble(config, vocab, embed, layers, final_norm, lm_head, device)
    }

    fn assemble(
        config: Qwen2Config,
        vocab: Range<usize>,
        embed: Tensor<2>,
        layers: Vec<Qwen2DecoderLayer>,
        norm: RmsNorm,
        lm_head: Tensor<2>,
        device: &Device,
    ) -> Self {
        let rotary = RotaryEmbedding::new(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            device,
        );
        Self {
            embed_tokens: Param::from_tensor(embed),
            layers,
            norm,
            lm_head: Linear::new(lm_head, None),
            rotary,
            config,
            vocab,
            checkpoint_kv_scales: None,
        }
    }

    /// This rank's place and collective under tensor parallelism (`None`: the whole model).
    pub fn parallel(&self) -> Option<&Parallel> {
        self.layers.first().and_then(|l| l.parallel.as_ref())
    }

    /// The collective of a rank whose embedding and LM head hold only part of the vocabulary
    /// ([`Self::vocab`]); `None` when they hold all of it.
    pub fn vocab_split(&self) -> Option<&Parallel> {
        self.parallel()
            .filter(|_| self.vocab.len() < self.config.vocab_size)
    }

    /// Sets how every product of the model (and its attention) reduces: with
    /// [`ReductionOrder::BatchInvariant`] a token's logits do not depend on the other rows of
    /// its step ([`cubecl_kernels::ReductionOrder`]).
    pub fn set_reduction_order(&mut self, order: ReductionOrder) {
        for layer in &mut self.layers {
            layer.self_attn.qkv_proj.order = order;
            layer.self_attn.o_proj.order = order;
            layer.mlp.gate_up_proj.order = order;
            layer.mlp.down_proj.order = order;
        }
        self.lm_head.order = order;
        if let Some(p) = self.parallel() {
            p.all_reduce
                .set_fixed_order(order == ReductionOrder::BatchInvariant);
        }
    }

    /// How the model's products reduce ([`Self::set_reduction_order`]).
    pub fn reduction_order(&self) -> ReductionOrder {
        self.lm_head.order
    }

    /// The compute dtype of the weights.
    pub fn dtype(&self) -> DType {
        self.embed_tokens.val().dtype()
    }

    /// Checks token ids against the vocabulary and uploads them, `[num_tokens]`.
    pub fn input_ids(&self, ids: &[u32], device: &Device) -> Result<Tensor<1, Int>> {
        if let Some(&bad) = ids
            .iter()
            .find(|&&id| id as usize >= self.config.vocab_size)
        {
            return Err(ModelError::Input(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.config.vocab_size
            )));
        }
        let ids: Vec<i32> = ids.iter().map(|&v| v as i32).collect();
        let n = ids.len();
        Ok(Tensor::from_data(
            TensorData::new(ids, [n]),
            (device, DType::I32),
        ))
    }

    /// Embedding lookup. `input_ids [T]` → `[T, H]`. Ids are clamped into the vocabulary on
    /// the device first: the gather reads unchecked, and a drawn id fed back without a host
    /// round trip is checked on the host only after the step that reads it (the request is
    /// failed there; the device never reads out of bounds). Under tensor parallelism each rank
    /// looks up the ids of its rows ([`Self::vocab`]; zeros for the others) and the ranks sum.
    pub fn embed(&self, input_ids: Tensor<1, Int>) -> Tensor<2> {
        let table = self.embed_tokens.val();
        let ids = input_ids.clamp(0, self.config.vocab_size as i64 - 1);
        let Some(parallel) = self.vocab_split() else {
            return table.select(0, ids);
        };
        let rows = table.dims()[0] as i64;
        let local = ids.sub_scalar(self.vocab.start as i64);
        let elsewhere = local
            .clone()
            .lower_elem(0)
            .bool_or(local.clone().greater_equal_elem(rows));
        let x = table.select(0, local.clamp(0, rows - 1));
        let [t, h] = x.dims();
        let x = x.mask_fill(elsewhere.unsqueeze_dim::<2>(1).expand([t, h]), 0.0);
        parallel.all_reduce.sum(x)
    }

    /// Runs the decoder over a flattened batch and returns f32 logits.
    ///
    /// `input_ids [num_tokens]` → `[num_tokens, V]` ([`LogitsRows::All`]), `[B, V]`
    /// ([`LogitsRows::LastPerSequence`]) or `[n, V]` ([`LogitsRows::Rows`]). Writes the batch's
    /// keys and values into `cache`.
    pub fn forward(
        &self,
        input_ids: Tensor<1, Int>,
        meta: &AttentionMetadata,
        cache: &mut KvCache,
        rows: LogitsRows,
    ) -> Tensor<2> {
        self.forward_model_dtype(input_ids, meta, cache, rows)
            .cast(FloatDType::F32)
    }

    /// [`Self::forward`] with the logits in the model's dtype (bf16 for a bf16 checkpoint), as
    /// the LM head writes them: for consumers that read them as they are, such as
    /// `cubecl_kernels::sample`, which then need no f32 copy of `[rows, V]` (at 256 rows of a
    /// 152k vocabulary, 155 MB written and read every decode step). Same shapes as `forward`
    /// (gathered from the ranks under tensor parallelism).
    pub fn forward_model_dtype(
        &self,
        input_ids: Tensor<1, Int>,
        meta: &AttentionMetadata,
        cache: &mut KvCache,
        rows: LogitsRows,
    ) -> Tensor<2> {
        let logits = self.forward_vocab_shard(input_ids, meta, cache, rows);
        match self.vocab_split() {
            Some(p) => p.gather_vocab(logits, self.vocab.start, self.config.vocab_size),
            None => logits,
        }
    }

    /// [`Self::forward_model_dtype`]'s columns of this rank's tokens ([`Self::vocab`]):
    /// `[rows, V_shard]`, not gathered (the whole logits when the vocabulary is not split).
    pub fn forward_vocab_shard(
        &self,
        input_ids: Tensor<1, Int>,
        meta: &AttentionMetadata,
        cache: &mut KvCache,
        rows: LogitsRows,
    ) -> Tensor<2> {
        let h = self.forward_hidden(input_ids, meta, cache);
        let h = match rows {
            LogitsRows::All => h,
            LogitsRows::LastPerSequence if meta.is_decode() => h,
            LogitsRows::LastPerSequence => {
                let last: Vec<i32> = meta.cu_seqlens_q()[1..]
                    .iter()
                    .map(|&e| e as i32 - 1)
                    .collect();
                let n = last.len();
                let idx = Tensor::<1, Int>::from_data(
                    TensorData::new(last, [n]),
                    (&h.device(), DType::I32),
                );
                h.select(0, idx)
            }
            LogitsRows::Rows(idx) => h.select(0, *idx),
        };
        self.norm.forward_linear(h, &self.lm_head)
    }

    /// Runs the decoder layers; returns the final residual stream `[num_tokens, H]` (before
    /// the final norm).
    pub fn forward_hidden(
        &self,
        input_ids: Tensor<1, Int>,
        meta: &AttentionMetadata,
        cache: &mut KvCache,
    ) -> Tensor<2> {
        let mut h = self.embed(input_ids);
        for (layer, layer_cache) in self.layers.iter().zip(cache.layers.iter_mut()) {
            h = layer.forward(h, &self.rotary, meta, layer_cache);
        }
        h
    }
}

/// A rank's place (checked against `c`) and the tokens of its embedding and LM head rows: its
/// [`TpRank::vocab`] share with [`Parallel::vocab_parallel`], else the whole vocabulary.
fn rank_share(parallel: Option<&Parallel>, c: &Qwen2Config) -> Result<(TpRank, Range<usize>)> {
    let tp = match parallel {
        Some(p) => TpRank::new(p.rank.rank, p.rank.size, c)?,
        None => TpRank::SINGLE,
    };
    let vocab = match parallel {
        Some(p) if p.vocab_parallel => tp.vocab(c),
        _ => 0..c.vocab_size,
    };
    Ok((tp, vocab))
}

/// The checkpoint's KV-cache scales ([`Qwen2Model::checkpoint_kv_scales`]): every layer's
/// `k_scale` and `v_scale` (or `kv_scale` for both), each given to the rank's `kv_heads`; `None`
/// when no layer has one, an error naming the first missing one when only some do.
fn read_kv_scales(
    ckpt: &mut Checkpoint,
    layers: usize,
    kv_heads: usize,
) -> Result<Option<KvScales>> {
    let (mut keys, mut values, mut missing) = (Vec::new(), Vec::new(), None);
    for l in 0..layers {
        let attn = format!("model.layers.{l}.self_attn");
        let both = ckpt.scalar(&format!("{attn}.kv_scale"))?;
        let k = ckpt.scalar(&format!("{attn}.k_scale"))?.or(both);
        let v = ckpt.scalar(&format!("{attn}.v_scale"))?.or(both);
        match (k, v) {
            (Some(k), Some(v)) => {
                keys.push(vec![k; kv_heads]);
                values.push(vec![v; kv_heads]);
            }
            (k, _) => {
                let which = if k.is_none() { "k_scale" } else { "v_scale" };
                missing.get_or_insert(format!("{attn}.{which}"));
            }
        }
    }
    match missing {
        None => Ok(Some(KvScales { keys, values })),
        Some(_) if keys.is_empty() => Ok(None),
        Some(name) => Err(ModelError::MissingTensor(format!(
            "{name} (other layers carry KV-cache scales)"
        ))),
    }
}
