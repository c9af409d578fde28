//! Writing host values into an existing device buffer in place.
//!
//! A replayed CUDA graph reads the exact buffers it was captured with, so a decode step's
//! inputs (token ids, positions, slots, context lengths, block tables) must be refreshed in
//! those buffers rather than re-uploaded into new ones. The write is an op on the device's
//! stream (and, under fusion, on the fusion queue), so it is ordered before the next replay.

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::IntTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_cubecl::{CubeBackend, tensor::CubeTensor};
use cubecl::bytes::Bytes;
use cubecl::prelude::{CubeCount, CubeDim};

use crate::KernelError;

/// Host values to write into a device buffer in place, `offset` elements in (see
/// [`crate::write_ints`]).
#[derive(Clone, Debug)]
pub struct HostInts {
    /// Where in the buffer the values go.
    pub offset: usize,
    /// The values.
    pub values: std::sync::Arc<Vec<i32>>,
}

/// Writes `values` into `dst[offset..offset + values.len()]` (`dst`: `[n]` i32) in place. On
/// CubeCL devices the buffer keeps its address (one host-to-device copy); elsewhere (no graphs
/// there) `dst` is replaced by a new tensor holding the new values. Keep 2-D inputs (block
/// tables) as 1-D buffers and hand the kernels reshaped views: a 2-D device tensor may be
/// row-pitched.
pub fn write_ints(
    dst: &mut Tensor<1, Int>,
    offset: usize,
    values: &[i32],
) -> Result<(), KernelError> {
    let n = dst.dims()[0];
    if offset.checked_add(values.len()).is_none_or(|end| end > n) || dst.dtype() != DType::I32 {
        return Err(KernelError::invalid(format!(
            "write_ints: destination {:?} {:?}, {} i32 values at offset {offset}",
            dst.dims(),
            dst.dtype(),
            values.len()
        )));
    }
    if values.is_empty() {
        return Ok(());
    }
    if !is_cube(&dst.device()) {
        let device = dst.device();
        let mut all: Vec<i32> = dst
            .clone()
            .into_data()
            .try_into_vec_as::<i32>()
            .map_err(|e| KernelError::invalid(format!("write_ints: {e:?}")))?;
        all[offset..offset + values.len()].copy_from_slice(values);
        *dst = Tensor::from_data(TensorData::new(all, [n]), (&device, DType::I32));
        return Ok(());
    }
    let host = HostInts {
        offset,
        values: std::sync::Arc::new(values.to_vec()),
    };
    let out = Dispatch::write_ints(dst.extract().into_dispatch(), host);
    *dst = Tensor::from_dispatch(out);
    Ok(())
}

/// Writes `dst[index] = value` for each `(index, value)` of `entries` (`dst`: `[n]` i32), in
/// place: one upload of the pairs and one kernel on CubeCL devices, so a
/// step that changes a few entries spread over a large buffer (block tables) moves only those;
/// elsewhere `dst` is replaced by a new tensor. Fails on an index out of range.
pub fn scatter_ints(dst: &mut Tensor<1, Int>, entries: &[[i32; 2]]) -> Result<(), KernelError> {
    let n = dst.dims()[0];
    if dst.dtype() != DType::I32 {
        return Err(KernelError::invalid(format!(
            "scatter_ints: destination {:?} {:?}; expected i32",
            dst.dims(),
            dst.dtype()
        )));
    }
    if let Some(bad) = entries.iter().find(|[i, _]| *i < 0 || *i as usize >= n) {
        return Err(KernelError::invalid(format!(
            "scatter_ints: index {} outside a buffer of {n} values",
            bad[0]
        )));
    }
    if entries.is_empty() {
        return Ok(());
    }
    let device = dst.device();
    if !is_cube(&device) {
        let mut all: Vec<i32> = dst
            .clone()
            .into_data()
            .try_into_vec_as::<i32>()
            .map_err(|e| KernelError::invalid(format!("scatter_ints: {e:?}")))?;
        for &[i, v] in entries {
            all[i as usize] = v;
        }
        *dst = Tensor::from_data(TensorData::new(all, [n]), (&device, DType::I32));
        return Ok(());
    }
    let flat: Vec<i32> = entries.iter().flatten().copied().collect();
    let pairs = Tensor::<1, Int>::from_data(
        TensorData::new(flat, [2 * entries.len()]),
        (&device, DType::I32),
    );
    let out = Dispatch::scatter_ints(dst.extract().into_dispatch(), pairs.into_dispatch());
    *dst = Tensor::from_dispatch(out);
    Ok(())
}

/// True on the CubeCL devices (in-place writes and kernels).
fn is_cube(device: &burn::tensor::Device) -> bool {
    #[allow(unreachable_patterns)]
    match device.as_dispatch() {
        #[cfg(any(feature = "cpu", feature = "cuda"))]
        burn::backend::DispatchDevice::Cube(_) => true,
        _ => false,
    }
}

/// Units per cube of [`kernel::scatter_pairs`].
const SCATTER_UNITS: u32 = 256;

/// Device code of [`scatter_ints`].
mod kernel {
    use cubecl::prelude::*;

    /// `dst[pairs[2i]] = pairs[2i + 1]` for every pair, one unit per pair.
    #[cube(launch_unchecked)]
    pub fn scatter_pairs(dst: &mut Tensor<i32>, pairs: &Tensor<i32>) {
        let i = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
        if i < pairs.len() / 2 {
            dst[pairs[2 * i] as usize] = pairs[2 * i + 1];
        }
    }
}

/// The CubeCL side of [`scatter_ints`] (indices checked by the caller).
pub(crate) fn scatter_cube(dst: CubeTensor, pairs: CubeTensor) -> CubeTensor {
    let count = pairs.meta.shape()[0] / 2;
    assert!(
        dst.is_contiguous() && pairs.is_contiguous() && dst.dtype == DType::I32,
        "scatter_ints: contiguous i32 buffers expected"
    );
    if count == 0 {
        return dst;
    }
    // SAFETY: every unit below `count` reads its pair and writes one index the host checked
    // against the destination's length.
    unsafe {
        kernel::scatter_pairs::launch_unchecked(
            &dst.client,
            CubeCount::Static((count as u32).div_ceil(SCATTER_UNITS), 1, 1),
            CubeDim::new_1d(SCATTER_UNITS),
            dst.clone().into_tensor_arg(),
            pairs.into_tensor_arg(),
        );
    }
    dst
}

/// The CubeCL side: a host-to-device copy into `dst`'s own buffer, `offset` elements in.
pub(crate) fn write_cube(dst: CubeTensor, offset: usize, values: &[i32]) -> CubeTensor {
    let n = dst.meta.shape().iter().product::<usize>();
    assert!(
        dst.is_contiguous() && offset + values.len() <= n,
        "write_ints: the destination must be a contiguous tensor holding {} elements at {offset}",
        values.len()
    );
    let start = (offset * std::mem::size_of::<i32>()) as u64;
    let end = ((n - offset - values.len()) * std::mem::size_of::<i32>()) as u64;
    let span = dst.handle.clone().offset_start(start).offset_end(end);
    dst.client.write(&span, Bytes::from_elems(values.to_vec()));
    dst
}

/// In-place writes of host values as a Burn backend extension (the `Fusion` wrapper is generated:
/// each op is an opaque deferred operation on the fusion stream). Call it through this module's
/// functions, which check arguments and fall back to plain Burn off CubeCL devices.
#[backend_extension(Cube, Fusion)]
pub trait HostWriteOps: Backend {
    /// Writes `values` into `dst` (`[n]` i32, contiguous) from `values.offset` on, in place, and
    /// returns it: the buffer keeps its address, so a captured graph that reads it sees them.
    #[fusion(meta = write_ints_meta)]
    fn write_ints(dst: IntTensor<Self>, values: HostInts) -> IntTensor<Self>;

    /// `dst[pairs[2i]] = pairs[2i + 1]` for each pair of `pairs [2n]` (i32, indices below
    /// `dst`'s length), in place; returns `dst`, which keeps its address.
    #[fusion(meta = scatter_ints_meta)]
    fn scatter_ints(dst: IntTensor<Self>, pairs: IntTensor<Self>) -> IntTensor<Self>;
}

fn write_ints_meta(dst: &TensorSpec, _values: &HostInts) -> TensorSpec {
    dst.clone()
}

fn scatter_ints_meta(dst: &TensorSpec, _pairs: &TensorSpec) -> TensorSpec {
    dst.clone()
}

impl HostWriteOps for CubeBackend {
    fn write_ints(dst: IntTensor<Self>, values: HostInts) -> IntTensor<Self> {
        write_cube(dst, values.offset, &values.values)
    }

    fn scatter_ints(dst: IntTensor<Self>, pairs: IntTensor<Self>) -> IntTensor<Self> {
        scatter_cube(dst, pairs)
    }
}
