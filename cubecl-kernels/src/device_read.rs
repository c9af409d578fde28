//! Reading a small device buffer back without waiting for it: the copy is enqueued on the
//! device's stream now, right behind the work that writes the buffer, and the host waits for
//! it later — after it has enqueued more work (an engine's next step) behind the copy.
//!
//! A Burn read (`Tensor::into_data`) cannot do that: its copy is enqueued only when the read is
//! awaited, behind everything enqueued before, so a read of step N's tokens issued after step
//! N + 1 was enqueued would wait for step N + 1 as well. Here an op ([`DeviceReadOps::read_ints`])
//! rides the fusion queue to the buffer, enqueues CubeCL's asynchronous copy (copy, then a
//! fence) and leaves its future in a slot; the queue is flushed to the device at once.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::IntTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Int, Tensor};
use burn_cubecl::{CubeBackend, tensor::CubeTensor};
use cubecl::server::{CopyDescriptor, ServerError};

use crate::KernelError;

type CopyFuture =
    Pin<Box<dyn Future<Output = Result<Vec<cubecl::bytes::Bytes>, ServerError>> + Send>>;

/// An enqueued copy: its future, and the client it was made from (the future's type borrows
/// the client, so the client lives on the heap beside it and is dropped after it).
struct EnqueuedCopy {
    future: CopyFuture,
    _client: Arc<cubecl::client::Client>,
}

/// Where the read op of [`crate::read_ints_async`] leaves the enqueued copy.
#[derive(Clone, Default)]
pub struct ReadSlot(Arc<Mutex<Option<EnqueuedCopy>>>);

impl fmt::Debug for ReadSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReadSlot")
    }
}

/// The CubeCL side: enqueues the copy of `src` (contiguous i32) and its fence.
pub(crate) fn start_cube(src: &CubeTensor, slot: &ReadSlot) {
    assert!(
        src.dtype == DType::I32 && src.is_contiguous(),
        "read_ints: the source must be a contiguous i32 tensor (got {:?})",
        src.dtype
    );
    let descriptor = CopyDescriptor::new(
        src.handle.clone().binding(),
        src.meta.shape().clone(),
        src.meta.strides().clone(),
        std::mem::size_of::<i32>(),
    );
    let client = Arc::new(src.client.clone());
    // The copy and its fence are enqueued by this call; the future only waits.
    let future: Pin<Box<dyn Future<Output = _> + Send + '_>> =
        Box::pin(client.read_tensor_async(vec![descriptor]));
    // SAFETY: the future may borrow `*client` (its type says so), which lives on the heap
    // behind the `Arc` stored beside it in `EnqueuedCopy`: it neither moves nor drops before the
    // future, which is declared (so dropped) first and is never moved out without it.
    let future: CopyFuture = unsafe { std::mem::transmute(future) };
    *slot.0.lock().expect("read slot") = Some(EnqueuedCopy {
        future,
        _client: client,
    });
}

/// A read of `[n]` i32 values in flight ([`read_ints_async`]).
pub enum PendingInts {
    /// The copy is enqueued; its future waits on the fence behind it.
    Copying(ReadSlot),
    /// Read already (devices without an asynchronous path).
    Ready(Vec<i32>),
}

impl fmt::Debug for PendingInts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Copying(_) => f.write_str("PendingInts::Copying"),
            Self::Ready(v) => write!(f, "PendingInts::Ready({} values)", v.len()),
        }
    }
}

impl PendingInts {
    /// Waits for the copy (and so for the work before it on the stream) and returns the values.
    pub fn wait(self) -> Result<Vec<i32>, KernelError> {
        let slot = match self {
            Self::Ready(values) => return Ok(values),
            Self::Copying(slot) => slot,
        };
        let copy = slot.0.lock().expect("read slot").take().ok_or_else(|| {
            KernelError::invalid("read_ints: the copy was never enqueued".to_string())
        })?;
        let EnqueuedCopy { future, _client } = copy;
        let bytes = cubecl::future::block_on(future)
            .map_err(|e| KernelError::invalid(format!("read_ints: {e}")))?;
        let bytes = bytes
            .first()
            .ok_or_else(|| KernelError::invalid("read_ints: no data came back".to_string()))?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// Starts reading `src` (`[n]` i32) back to the host and returns at once: on CubeCL devices
/// the copy is enqueued on the stream behind the work that writes `src` (the fusion queue is
/// flushed to the device, without waiting for it), so work enqueued after this call does not
/// delay the read. Elsewhere the values are read now.
pub fn read_ints_async(src: &Tensor<1, Int>) -> Result<PendingInts, KernelError> {
    if src.dtype() != DType::I32 {
        return Err(KernelError::invalid(format!(
            "read_ints_async: the source must be i32 (got {:?})",
            src.dtype()
        )));
    }
    let device = src.device();
    let on_cube = {
        #[allow(unreachable_patterns)]
        match device.as_dispatch() {
            #[cfg(any(feature = "cpu", feature = "cuda"))]
            burn::backend::DispatchDevice::Cube(_) => true,
            _ => false,
        }
    };
    if !on_cube || src.dims()[0] == 0 {
        let values = src
            .clone()
            .into_data()
            .try_into_vec_as::<i32>()
            .map_err(|e| KernelError::invalid(format!("read_ints_async: {e:?}")))?;
        return Ok(PendingInts::Ready(values));
    }
    let slot = ReadSlot::default();
    let out = Dispatch::read_ints(src.clone().extract().into_dispatch(), slot.clone());
    run_now(out, &device, "read_ints_async")?;
    Ok(PendingInts::Copying(slot))
}

/// Runs the op that produced `out` now: flushes the fusion queue to the device (without
/// waiting for the device) while `out` is alive — a lazy backend skips ops whose outputs are
/// gone.
pub(crate) fn run_now(
    out: burn::backend::tensor::IntTensor<Dispatch>,
    device: &burn::tensor::Device,
    what: &str,
) -> Result<(), KernelError> {
    let kept = Tensor::<1, Int>::from_dispatch(out);
    Dispatch::flush(device.as_dispatch())
        .map_err(|e| KernelError::invalid(format!("{what}: flush: {e:?}")))?;
    drop(kept);
    Ok(())
}

/// The stream-ordered device-to-host copy as a Burn backend extension (the `Fusion` wrapper is
/// generated: each op is an opaque deferred operation on the fusion stream). Call it through this
/// module's functions, which check arguments and fall back to plain Burn off CubeCL devices.
#[backend_extension(Cube, Fusion)]
pub trait DeviceReadOps: Backend {
    /// Starts copying `src` (`[n]` i32, contiguous) to the host: the copy is enqueued on the
    /// device's stream when the op runs and its future left in `read` (see
    /// [`crate::read_ints_async`]). Returns `src`.
    #[fusion(meta = read_ints_meta)]
    fn read_ints(src: IntTensor<Self>, read: ReadSlot) -> IntTensor<Self>;
}

fn read_ints_meta(src: &TensorSpec, _read: &ReadSlot) -> TensorSpec {
    src.clone()
}

impl DeviceReadOps for CubeBackend {
    fn read_ints(src: IntTensor<Self>, read: ReadSlot) -> IntTensor<Self> {
        start_cube(&src, &read);
        src
    }
}
