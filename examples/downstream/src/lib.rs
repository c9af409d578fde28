//! A model author's view of burn-nanovllm: a Llama-style pre-norm transformer block written with
//! Burn's own modules ([`Block`]), and the same block with burn-nanovllm's fused ops swapped in
//! ([`FusedBlock`]), computing the same function.
//!
//! The swap, in [`FusedBlock::from_block`]:
//! - attention input: `RmsNorm` then the q, k and v `Linear`s become one
//!   [`FusedRmsNormLinear`] over the merged `[q; k; v]` weight (the normalised activations never
//!   reach memory on CubeCL devices);
//! - o_proj and down_proj with their residual additions become [`linear_add`] (the residual rides
//!   in the product's epilogue);
//! - MLP input, the deferred-norm route: the norm's gain is folded into the merged `[gate; up]`
//!   weight once ([`fold_norm_gain`]), the product reads the raw residual stream, and
//!   [`silu_mul`] applies each row's `1/rms` ([`RowScale`]) together with the activation, so no
//!   norm kernel runs at all.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig, RmsNorm, RmsNormConfig};
use burn::tensor::activation::silu;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{DType, Device, Distribution, Tensor};
use cubecl_kernels::{FusedRmsNormLinear, RowScale, fold_norm_gain, linear, linear_add, silu_mul};

/// Sizes of a [`Block`].
#[derive(Clone, Copy, Debug)]
pub struct BlockConfig {
    /// Residual stream width `H`.
    pub hidden: usize,
    /// Attention heads (`H / heads` per head).
    pub heads: usize,
    /// MLP width `I`.
    pub intermediate: usize,
}

/// A pre-norm decoder block with Burn's modules:
/// `x += o(attn(q(n1(x)), k(n1(x)), v(n1(x))))`, then `x += down(silu(gate(n2(x))) · up(n2(x)))`.
#[derive(Module, Debug)]
pub struct Block {
    /// RMSNorm before attention, gain `[H]`.
    pub attn_norm: RmsNorm,
    /// Query, key, value and output projections, `H → H` (Burn's `[in, out]` weights).
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    /// RMSNorm before the MLP, gain `[H]`.
    pub mlp_norm: RmsNorm,
    /// Gate and up projections `H → I`, down projection `I → H`.
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    /// Attention heads.
    pub heads: usize,
}

impl Block {
    /// Random weights (the norms' gains too) of `dtype` on `device`.
    pub fn random(c: BlockConfig, dtype: DType, device: &Device) -> Self {
        let linear = |i: usize, o: usize, bias: bool| {
            let mut l = LinearConfig::new(i, o).with_bias(bias).init(device);
            let scale = 1.0 / (i as f64).sqrt();
            l.weight = Param::from_tensor(Tensor::random(
                [i, o],
                Distribution::Uniform(-scale, scale),
                (device, dtype),
            ));
            l.bias = l.bias.map(|b| {
                Param::from_tensor(Tensor::random(
                    b.dims(),
                    Distribution::Uniform(-0.1, 0.1),
                    (device, dtype),
                ))
            });
            l
        };
        let norm = || {
            let mut n = RmsNormConfig::new(c.hidden).with_epsilon(1e-6).init(device);
            n.gamma = Param::from_tensor(Tensor::random(
                [c.hidden],
                Distribution::Uniform(0.5, 1.5),
                (device, dtype),
            ));
            n
        };
        Self {
            attn_norm: norm(),
            q: linear(c.hidden, c.hidden, true),
            k: linear(c.hidden, c.hidden, true),
            v: linear(c.hidden, c.hidden, true),
            o: linear(c.hidden, c.hidden, false),
            mlp_norm: norm(),
            gate: linear(c.hidden, c.intermediate, false),
            up: linear(c.hidden, c.intermediate, false),
            down: linear(c.intermediate, c.hidden, false),
            heads: c.heads,
        }
    }

    /// `x [B, S, H]` → `[B, S, H]`, causal attention within each sequence.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let h = self.attn_norm.forward(x.clone());
        let attn = causal_attention(
            self.q.forward(h.clone()),
            self.k.forward(h.clone()),
            self.v.forward(h),
            self.heads,
        );
        let x = x + self.o.forward(attn);
        let h = self.mlp_norm.forward(x.clone());
        let mlp = silu(self.gate.forward(h.clone())) * self.up.forward(h);
        x.clone() + self.down.forward(mlp)
    }
}

/// [`Block`] with burn-nanovllm's fused ops (module doc). Weights in the Hugging Face layout
/// `[out, in]`, which the kernels stream row by row.
#[derive(Module, Debug)]
pub struct FusedBlock {
    /// `attn_norm` + `[q; k; v]`: `[3H, H]`.
    pub qkv: FusedRmsNormLinear,
    /// `[H, H]`.
    pub o: Param<Tensor<2>>,
    /// `[gate; up]` with `mlp_norm`'s gain folded in: `[2I, H]`.
    pub gate_up: Param<Tensor<2>>,
    /// `mlp_norm`'s epsilon, for the deferred row scale.
    pub mlp_eps: f64,
    /// `[H, I]`.
    pub down: Param<Tensor<2>>,
    /// Attention heads.
    pub heads: usize,
}

impl FusedBlock {
    /// The same weights, rearranged once.
    pub fn from_block(b: &Block) -> Self {
        // Burn stores `Linear` weights `[in, out]`; a contiguous copy of the transpose is `[out, in]`.
        let hf = |l: &Linear| l.weight.val().transpose();
        let contiguous = |t: Tensor<2>| {
            let (device, dtype) = (t.device(), t.dtype());
            Tensor::<2>::from_data(t.into_data(), (&device, dtype))
        };
        let bias = |l: &Linear| l.bias.as_ref().map(Param::val);
        let qkv_bias = Tensor::cat(
            vec![bias(&b.q).unwrap(), bias(&b.k).unwrap(), bias(&b.v).unwrap()],
            0,
        );
        let qkv = FusedRmsNormLinear::new(
            b.attn_norm.gamma.val(),
            contiguous(Tensor::cat(vec![hf(&b.q), hf(&b.k), hf(&b.v)], 0)),
            Some(qkv_bias),
            b.attn_norm.epsilon,
        );
        let gate_up = Tensor::cat(vec![hf(&b.gate), hf(&b.up)], 0);
        Self {
            qkv,
            o: Param::from_tensor(contiguous(hf(&b.o))),
            gate_up: Param::from_tensor(contiguous(fold_norm_gain(
                gate_up,
                b.mlp_norm.gamma.val(),
            ))),
            mlp_eps: b.mlp_norm.epsilon,
            down: Param::from_tensor(contiguous(hf(&b.down))),
            heads: b.heads,
        }
    }

    /// `x [B, S, H]` → `[B, S, H]`, as [`Block::forward`].
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [batch, seq, hidden] = x.dims();
        let x = x.reshape([batch * seq, hidden]);
        let qkv = self.qkv.forward(x.clone());
        let part = |i: usize| {
            qkv.clone()
                .narrow(1, i * hidden, hidden)
                .reshape([batch, seq, hidden])
        };
        let attn = causal_attention(part(0), part(1), part(2), self.heads);
        let x = linear_add(
            attn.reshape([batch * seq, hidden]),
            self.o.val(),
            None,
            x,
        );
        let gate_up = linear(x.clone(), self.gate_up.val(), None);
        let act = silu_mul(
            gate_up,
            Some(RowScale {
                input: &x,
                bias: None,
                eps: self.mlp_eps,
            }),
        );
        let x = linear_add(act, self.down.val(), None, x.clone());
        x.reshape([batch, seq, hidden])
    }
}

/// Causal multi-head attention: `q`, `k`, `v [B, S, H]` → `[B, S, H]`.
fn causal_attention(q: Tensor<3>, k: Tensor<3>, v: Tensor<3>, heads: usize) -> Tensor<3> {
    let [b, s, hidden] = q.dims();
    let split = |t: Tensor<3>| t.reshape([b, s, heads, hidden / heads]).swap_dims(1, 2);
    let out = burn::tensor::module::attention(
        split(q),
        split(k),
        split(v),
        None,
        None,
        AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: true,
        },
    );
    out.swap_dims(1, 2).reshape([b, s, hidden])
}
