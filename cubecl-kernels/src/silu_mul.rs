//! The SiLU-gated activation of a merged gate/up projection, with the projection's deferred
//! RMSNorm row scale and bias applied on the way in (see [`crate::row_scale`]).
//!
//! Memory layout: `gate_up [T, 2·I]` row-major (gate in columns `0..I`, up in `I..2·I`), unit
//! inner stride; `x [T, K]` (the row-scale input); `bias [2·I]`; output `[T, I]`.
//!
//! Launch geometry: cubes `(t, chunk)`, each covering `chunk_vecs` vectors of `NV` outputs of row
//! `t`; unit `u` takes vectors `u + j·cube_dim` of the chunk. A unit issues the gate and up loads
//! of its first `held` vectors before anything else; with a row scale the cube then reduces the
//! row of `x` (`row_scale::row_inv_rms`; every chunk of a row recomputes it) while those loads are in
//! flight, and the unit strides over the rest of its chunk. With at least two rows per
//! multiprocessor a row is one chunk (`held` = 4); with fewer rows the chunks are
//! `cube_dim · held` vectors, `held` the largest of 4, 2, 1 that still gives two cubes per
//! multiprocessor, so that a decode step's few rows spread over the device.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::activation::silu;
use burn::tensor::{Shape, Tensor};
use burn_cubecl::{CubeBackend, ops::numeric::empty_device_dtype, tensor::CubeTensor};
use cubecl::prelude::{CubeCount, CubeDim};

use self::kernel::{SiluMulConfig, silu_mul_kernel};
use crate::device_caps::DeviceCaps;
use crate::row_scale::RowScale;
use crate::{KernelError, unit_inner_stride, vector_size};

/// `silu(gate) · up` of `gate_up [T, 2·I]` → `[T, I]`, the rows first scaled by `row_scale`
/// (`gate_up` is then the unscaled product of the MLP input `x`, the gain folded into its
/// weight) and biased. f32, f16 or bf16; arithmetic in f32, the scaled projection rounded to the
/// dtype first as the undeferred product would be.
///
/// # Panics
/// On an odd width or operands that do not match `gate_up`, naming the operand.
pub fn silu_mul(gate_up: Tensor<2>, row_scale: Option<RowScale<'_>>) -> Tensor<2> {
    let [t, width] = gate_up.dims();
    let check = || -> Result<(), KernelError> {
        if !width.is_multiple_of(2) {
            return Err(KernelError::invalid(format!(
                "gate_up has odd width {width}; expected [T, 2·I]"
            )));
        }
        match &row_scale {
            Some(s) => s.check(t, width, gate_up.dtype()),
            None => Ok(()),
        }
    };
    check().unwrap_or_else(|e| panic!("silu_mul: {e}"));
    if !crate::runs_kernels(&gate_up) {
        return reference(gate_up, row_scale);
    }
    let placeholder = || gate_up.clone().into_dispatch();
    let (x, bias, eps, flags) = match row_scale {
        Some(s) => (
            s.input.clone().into_dispatch(),
            s.bias.map(|b| b.clone().into_dispatch()),
            s.eps as f32,
            SiluMulFlags {
                scaled: true,
                has_bias: s.bias.is_some(),
            },
        ),
        None => (placeholder(), None, 0.0, SiluMulFlags::default()),
    };
    let bias = bias.unwrap_or_else(placeholder);
    Tensor::from_dispatch(Dispatch::silu_mul(
        gate_up.into_dispatch(),
        x,
        bias,
        eps,
        flags,
    ))
}

/// The plain-Burn definition of [`silu_mul`].
pub fn reference(gate_up: Tensor<2>, row_scale: Option<RowScale<'_>>) -> Tensor<2> {
    let gate_up = match row_scale {
        Some(s) => s.apply(gate_up),
        None => gate_up,
    };
    let i = gate_up.dims()[1] / 2;
    let gate = gate_up.clone().slice_dim(1, 0..i);
    let up = gate_up.slice_dim(1, i..2 * i);
    silu(gate) * up
}

/// Which optional operands of the op are present.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SiluMulFlags {
    /// Scale each row by `inv_rms(x)`.
    pub scaled: bool,
    /// Add `bias` after the scale (only with `scaled`).
    pub has_bias: bool,
}

mod kernel {
    use cubecl::prelude::*;

    use super::SiluMulFlags;
    use crate::row_scale::row_inv_rms;

    /// Comptime part of the launch.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct SiluMulConfig {
        pub flags: SiluMulFlags,
        /// Units per cube.
        pub cube_dim: usize,
        /// Output vectors per unit, loaded before any is used.
        pub held: usize,
        pub use_plane: bool,
    }

    /// See the module documentation.
    #[cube(launch_unchecked)]
    #[allow(clippy::too_many_arguments)]
    pub fn silu_mul_kernel<F: Float, NV: Size, XV: Size>(
        gate_up: &Tensor<Vector<F, NV>>,
        x: &Tensor<Vector<F, XV>>,
        bias: &Tensor<Vector<F, NV>>,
        out: &mut Tensor<Vector<F, NV>>,
        eps: f32,
        chunk_vecs: usize,
        #[comptime] cfg: SiluMulConfig,
        #[define(F)] _dtype: ElemType,
    ) {
        let row = CUBE_POS_X as usize;
        let nv = out.vector_size();
        let i_vecs = out.shape(1) / nv;
        let g_at = row * (gate_up.stride(0) / nv);
        let o_at = row * (out.stride(0) / nv);
        let start = CUBE_POS_Y as usize * chunk_vecs;
        let end = min(start + chunk_vecs, i_vecs);
        let first = start + UNIT_POS_X as usize;
        let mut gates = Array::<Vector<F, NV>>::new(cfg.held);
        let mut ups = Array::<Vector<F, NV>>::new(cfg.held);
        #[unroll]
        for j in 0..cfg.held {
            let i = first + j * cfg.cube_dim;
            let mut g = Vector::<F, NV>::new(F::new(0.0));
            let mut u = Vector::<F, NV>::new(F::new(0.0));
            if i < end {
                g = gate_up[g_at + i];
                u = gate_up[g_at + i_vecs + i];
            }
            gates[j] = g;
            ups[j] = u;
        }
        let mut scale = 1.0f32;
        if comptime!(cfg.flags.scaled) {
            let mut scratch = Shared::<[f32]>::new_slice(cfg.cube_dim);
            scale = row_inv_rms(x, row, eps, &mut scratch, cfg.use_plane);
        }
        #[unroll]
        for j in 0..cfg.held {
            let i = first + j * cfg.cube_dim;
            if i < end {
                out[o_at + i] = gated::<F, NV>(gates[j], ups[j], bias, i, i_vecs, scale, cfg.flags);
            }
        }
        let mut i = first + comptime!(cfg.held * cfg.cube_dim);
        while i < end {
            let (g, u) = (gate_up[g_at + i], gate_up[g_at + i_vecs + i]);
            out[o_at + i] = gated::<F, NV>(g, u, bias, i, i_vecs, scale, cfg.flags);
            i += cfg.cube_dim;
        }
    }

    /// `silu(g')·u'` of one vector pair, `g' = scale·g + bias[i]` and `u' = scale·u +
    /// bias[I/NV + i]` with a row scale (rounded to `F` as the undeferred product would be).
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn gated<F: Float, NV: Size>(
        g: Vector<F, NV>,
        u: Vector<F, NV>,
        bias: &Tensor<Vector<F, NV>>,
        i: usize,
        i_vecs: usize,
        scale: f32,
        #[comptime] flags: SiluMulFlags,
    ) -> Vector<F, NV> {
        let mut g = Vector::<f32, NV>::cast_from(g);
        let mut u = Vector::<f32, NV>::cast_from(u);
        if comptime!(flags.scaled) {
            let s = Vector::<f32, NV>::new(scale);
            g *= s;
            u *= s;
            if comptime!(flags.has_bias) {
                g += Vector::<f32, NV>::cast_from(bias[i]);
                u += Vector::<f32, NV>::cast_from(bias[i_vecs + i]);
            }
            // Rounded once, like the undeferred product's output.
            g = Vector::<f32, NV>::cast_from(Vector::<F, NV>::cast_from(g));
            u = Vector::<f32, NV>::cast_from(Vector::<F, NV>::cast_from(u));
        }
        let act = g / (Vector::<f32, NV>::new(1.0) + Vector::exp(Vector::<f32, NV>::new(0.0) - g));
        Vector::<F, NV>::cast_from(act * u)
    }
}

/// Host side of [`silu_mul`] on CubeCL tensors (arguments checked there).
pub(crate) fn launch(
    gate_up: CubeTensor,
    x: CubeTensor,
    bias: CubeTensor,
    eps: f32,
    flags: SiluMulFlags,
) -> CubeTensor {
    let gate_up = unit_inner_stride(gate_up);
    let x = unit_inner_stride(x);
    let (t, width) = (gate_up.meta.shape()[0], gate_up.meta.shape()[1]);
    let i = width / 2;
    let dtype = gate_up.dtype;
    let out = empty_device_dtype(
        gate_up.client.clone(),
        gate_up.device.clone(),
        Shape::new([t, i]),
        dtype,
    );
    if t == 0 || i == 0 {
        return out;
    }
    let caps = DeviceCaps::of(&gate_up.client);
    let nv = vector_size(
        dtype,
        &[i, gate_up.meta.strides()[0], out.meta.strides()[0]],
    );
    let xv = if flags.scaled {
        vector_size(dtype, &[x.meta.shape()[1], x.meta.strides()[0]])
    } else {
        1
    };
    let i_vecs = i / nv;
    let cube_dim = caps.cube_units.min(i_vecs.next_power_of_two()).max(1);
    let enough = 2 * caps.multiprocessors;
    let (held, chunk_vecs) = if t >= enough {
        (4, i_vecs)
    } else {
        let held = [4, 2]
            .into_iter()
            .find(|&h| t * i_vecs.div_ceil(cube_dim * h) >= enough)
            .unwrap_or(1);
        (held, cube_dim * held)
    };
    let cfg = SiluMulConfig {
        flags,
        cube_dim,
        held,
        use_plane: caps.plane_ops && cube_dim.is_multiple_of(caps.plane_size),
    };
    // SAFETY: cubes `(row, chunk)` with rows below `T`; vector indices are checked against the
    // row's `I / NV` (and stay below `K / XV` for `x`), the widths and row pitches being
    // multiples of the vectors.
    unsafe {
        silu_mul_kernel::launch_unchecked(
            &out.client,
            CubeCount::Static(t as u32, i_vecs.div_ceil(chunk_vecs) as u32, 1),
            CubeDim::new_1d(cube_dim as u32),
            nv,
            xv,
            gate_up.into_tensor_arg(),
            x.into_tensor_arg(),
            bias.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            eps,
            chunk_vecs,
            cfg,
            dtype_to_storage_type(dtype),
        );
    }
    out
}

/// `silu(gate)·up` as a Burn backend extension (the `Fusion` wrapper is generated: each op is an
/// opaque deferred operation on the fusion stream). Call it through this module's functions, which
/// check arguments and fall back to plain Burn off CubeCL devices.
#[backend_extension(Cube, Fusion)]
pub trait SiluMulOps: Backend {
    /// `silu(gate)·up` of `gate_up [T, 2·I]` → `[T, I]`, its rows first scaled by `inv_rms(x)`
    /// (`x [T, K]`) and biased (`bias [2·I]`) as `flags` says; absent operands are placeholders.
    #[fusion(meta = silu_mul_meta)]
    fn silu_mul(
        gate_up: FloatTensor<Self>,
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        flags: SiluMulFlags,
    ) -> FloatTensor<Self>;
}

fn silu_mul_meta(
    gate_up: &TensorSpec,
    _x: &TensorSpec,
    _bias: &TensorSpec,
    _eps: &f32,
    _flags: &SiluMulFlags,
) -> TensorSpec {
    TensorSpec::new(
        Shape::new([gate_up.shape[0], gate_up.shape[1] / 2]),
        gate_up.dtype,
    )
}

impl SiluMulOps for CubeBackend {
    fn silu_mul(
        gate_up: FloatTensor<Self>,
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        flags: SiluMulFlags,
    ) -> FloatTensor<Self> {
        launch(gate_up, x, bias, eps, flags)
    }
}
