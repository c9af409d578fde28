//! Writing host values into an existing device buffer in place.
//!
//! A replayed CUDA graph reads the exact buffers it was captured with, so a decode step's
//! inputs (token ids, positions, slots, context lengths, block tables) must be refreshed in
//! those buffers rather than re-uploaded into new ones. The write is an op on the device's
//! stream (and, under fusion, on the fusion queue), so it is ordered before the next replay.

use burn::backend::Dispatch;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_cubecl::tensor::CubeTensor;
use cubecl::bytes::Bytes;

use crate::KernelError;
use crate::ops::KernelOps;

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
    let on_cube = {
        #[allow(unreachable_patterns)]
        match dst.device().as_dispatch() {
            #[cfg(any(feature = "cpu", feature = "cuda"))]
            burn::backend::DispatchDevice::Cube(_) => true,
            _ => false,
        }
    };
    if !on_cube {
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
