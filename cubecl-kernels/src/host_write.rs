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
use crate::ops::{HostInts, KernelOps};

/// Writes `values` into `dst` (`[n]`, i32) in place. On CubeCL devices the buffer keeps its
/// address; elsewhere (no graphs there) `dst` is replaced by a new tensor of the same values.
/// Keep 2-D inputs (block tables) as 1-D buffers and hand the kernels reshaped views: a 2-D
/// device tensor may be row-pitched.
pub fn write_ints(dst: &mut Tensor<1, Int>, values: &[i32]) -> Result<(), KernelError> {
    if dst.dims()[0] != values.len() || dst.dtype() != DType::I32 {
        return Err(KernelError::invalid(format!(
            "write_ints: destination {:?} {:?}, {} i32 values",
            dst.dims(),
            dst.dtype(),
            values.len()
        )));
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
        *dst = Tensor::from_data(
            TensorData::new(values.to_vec(), [values.len()]),
            (&device, DType::I32),
        );
        return Ok(());
    }
    let host = HostInts(std::sync::Arc::new(values.to_vec()));
    let out = Dispatch::write_ints(dst.extract().into_dispatch(), host);
    *dst = Tensor::from_dispatch(out);
    Ok(())
}

/// The CubeCL side: a host-to-device copy into `dst`'s own buffer.
pub(crate) fn write_cube(dst: CubeTensor, values: &[i32]) -> CubeTensor {
    assert!(
        dst.is_contiguous() && dst.meta.shape().iter().product::<usize>() == values.len(),
        "write_ints: the destination must be a contiguous tensor of {} elements",
        values.len()
    );
    dst.client
        .write(&dst.handle, Bytes::from_elems(values.to_vec()));
    dst
}
