//! Host memory for an upload that is written in place and then copied to the device without
//! another host copy.
//!
//! CubeCL copies host data of under 100 MB into page-locked (pinned) memory before handing it
//! to the driver, on the calling thread; data that is pinned already goes to the driver as it
//! is. A large upload built on the host each step (structured outputs' token masks: 4.9 MB at
//! 256 rows of a 152k vocabulary) can therefore take its pinned memory first, before the values
//! are known, while the device is busy, be filled in place (by many threads), and leave for the
//! device with no copy on the host's critical path.

use burn::backend::DispatchDevice;
use burn::tensor::{DType, Device, TensorData};
use cubecl::bytes::Bytes;

/// `len` u32 values of host memory for an upload ([`UploadBuffer::into_data`] → a tensor):
/// page-locked on CUDA devices, plain memory elsewhere (or when CubeCL's pinned pool is
/// exhausted). Starts zeroed.
pub struct UploadBuffer {
    bytes: Bytes,
    len: usize,
}

impl UploadBuffer {
    /// A zeroed buffer of `len` u32 values for an upload to `device`.
    pub fn new(device: &Device, len: usize) -> Self {
        #[allow(unused_mut)]
        let mut bytes = Bytes::from_elems(vec![0u32; len]);
        #[allow(unreachable_patterns)]
        match device.as_dispatch() {
            // The CPU runtime has no staging memory: its request fails and the bytes stay.
            #[cfg(any(feature = "cpu", feature = "cuda"))]
            DispatchDevice::Cube(cube) if len > 0 => {
                cube.client().staging(std::iter::once(&mut bytes), false);
            }
            _ => {}
        }
        Self { bytes, len }
    }

    /// The values, to fill in place.
    pub fn as_mut_slice(&mut self) -> &mut [u32] {
        bytemuck::cast_slice_mut(&mut self.bytes[..self.len * 4])
    }

    /// The values as tensor data of `shape` (u32; its element count must be `len`), sharing
    /// the memory: `Tensor::from_data` on the buffer's device uploads it without a host copy.
    pub fn into_data(self, shape: impl Into<burn::tensor::Shape>) -> TensorData {
        TensorData::from_bytes(self.bytes, shape, DType::U32)
    }
}
