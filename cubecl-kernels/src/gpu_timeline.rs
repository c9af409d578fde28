//! Timestamps on the device's own stream (CUDA events), to see when the device works and when
//! it waits for the host: [`mark_stream`] records an event behind everything enqueued so far
//! (the fusion queue is flushed to the device first), [`GpuMark::ms_since`] reads the time
//! between two marks once both were reached. CUDA only, with the vendored cubecl-cuda that hands
//! out its stream (`cfg(cubecl_cuda_stream)`); elsewhere there is no mark.

use std::fmt;
use std::sync::{Arc, Mutex};

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::IntTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{Int, Tensor};
use burn_cubecl::{CubeBackend, tensor::CubeTensor};

use crate::KernelError;

/// A recorded event: its handle (a `CUevent`, as an address) and the client whose device thread
/// owns the CUDA context. Only the vendored cubecl-cuda records events: elsewhere (a dependent on
/// the published crate) none is ever made, and the fields are never read.
#[cfg_attr(not(all(feature = "cuda", cubecl_cuda_stream)), allow(dead_code))]
struct Event {
    event: usize,
    client: cubecl::client::Client,
}

impl Drop for Event {
    fn drop(&mut self) {
        #[cfg(all(feature = "cuda", cubecl_cuda_stream))]
        {
            let event = self.event;
            // SAFETY: the event was created by `record` and is destroyed once, on the device
            // thread that holds the context.
            let _ = self.client.exclusive(move || unsafe {
                cudarc::driver::sys::cuEventDestroy_v2(event as cudarc::driver::sys::CUevent)
            });
        }
    }
}

/// Where the op of [`crate::mark_stream`] leaves its event (empty where none can be recorded).
#[derive(Clone, Default)]
pub struct MarkSlot(Arc<Mutex<Option<Event>>>);

impl fmt::Debug for MarkSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MarkSlot")
    }
}

/// A point of the device's stream ([`mark_stream`]).
#[derive(Clone, Debug)]
pub struct GpuMark(MarkSlot);

impl GpuMark {
    /// Milliseconds from `earlier` to this mark on the device, once both were reached (waits
    /// for this one).
    pub fn ms_since(&self, earlier: &GpuMark) -> Result<f32, KernelError> {
        let (a, b) = (
            earlier.0.0.lock().expect("mark"),
            self.0.0.lock().expect("mark"),
        );
        let (Some(a), Some(b)) = (a.as_ref(), b.as_ref()) else {
            return Err(KernelError::invalid(
                "gpu mark: no event was recorded".to_string(),
            ));
        };
        elapsed(a, b)
    }
}

#[cfg(all(feature = "cuda", cubecl_cuda_stream))]
fn elapsed(a: &Event, b: &Event) -> Result<f32, KernelError> {
    use cudarc::driver::sys::{CUevent, CUresult, cuEventElapsedTime_v2, cuEventSynchronize};
    let (ea, eb) = (a.event, b.event);
    let result = b
        .client
        .exclusive(move || {
            let mut ms = 0f32;
            // SAFETY: both events were created and recorded by `record` on this context.
            let status = unsafe {
                match cuEventSynchronize(eb as CUevent) {
                    CUresult::CUDA_SUCCESS => {
                        cuEventElapsedTime_v2(&mut ms, ea as CUevent, eb as CUevent)
                    }
                    other => other,
                }
            };
            (status, ms)
        })
        .map_err(|e| KernelError::invalid(format!("gpu mark: {e:?}")))?;
    match result {
        (CUresult::CUDA_SUCCESS, ms) => Ok(ms),
        (status, _) => Err(KernelError::invalid(format!("gpu mark: {status:?}"))),
    }
}

#[cfg(not(all(feature = "cuda", cubecl_cuda_stream)))]
fn elapsed(_: &Event, _: &Event) -> Result<f32, KernelError> {
    Err(KernelError::invalid("gpu mark: not on CUDA".to_string()))
}

/// The CubeCL side: records an event on the stream `anchor`'s work is ordered on.
pub(crate) fn record(anchor: &CubeTensor, slot: &MarkSlot) {
    #[cfg(all(feature = "cuda", cubecl_cuda_stream))]
    {
        use cudarc::driver::sys::{CUevent, CUresult, cuEventCreate, cuEventRecord};
        type CudaServer = <cubecl::cuda::CudaRuntime as cubecl_runtime::runtime::Runtime>::Server;
        if !matches!(anchor.device, cubecl::Device::Cuda(_)) {
            return;
        }
        let Ok(resource) = anchor
            .client
            .get_resource::<CudaServer>(anchor.handle.clone())
        else {
            return;
        };
        let stream = resource.resource().stream as usize;
        let event = anchor.client.exclusive(move || {
            let mut event: CUevent = std::ptr::null_mut();
            // SAFETY: a default (timing) event, recorded on CubeCL's stream from its device
            // thread, behind every launch it issued before.
            unsafe {
                if cuEventCreate(&mut event, 0) != CUresult::CUDA_SUCCESS {
                    return None;
                }
                if cuEventRecord(event, stream as cudarc::driver::sys::CUstream)
                    != CUresult::CUDA_SUCCESS
                {
                    cudarc::driver::sys::cuEventDestroy_v2(event);
                    return None;
                }
            }
            Some(event as usize)
        });
        drop(resource);
        if let Ok(Some(event)) = event {
            *slot.0.lock().expect("mark") = Some(Event {
                event,
                client: anchor.client.clone(),
            });
        }
    }
    #[cfg(not(all(feature = "cuda", cubecl_cuda_stream)))]
    let _ = (anchor, slot);
}

/// Records a mark on the stream of `anchor`'s device behind everything enqueued so far, or
/// `None` where none can be (off CUDA, or built against the published cubecl-cuda).
pub fn mark_stream(anchor: &Tensor<1, Int>) -> Result<Option<GpuMark>, KernelError> {
    if !cfg!(all(feature = "cuda", cubecl_cuda_stream)) {
        return Ok(None);
    }
    let device = anchor.device();
    #[allow(unreachable_patterns)]
    match device.as_dispatch() {
        #[cfg(any(feature = "cpu", feature = "cuda"))]
        burn::backend::DispatchDevice::Cube(_) => {}
        _ => return Ok(None),
    }
    let slot = MarkSlot::default();
    let out = Dispatch::mark_stream(anchor.clone().extract().into_dispatch(), slot.clone());
    crate::device_read::run_now(out, &device, "gpu mark")?;
    let recorded = slot.0.lock().expect("mark").is_some();
    Ok(recorded.then_some(GpuMark(slot)))
}

/// Stream events as a Burn backend extension (the `Fusion` wrapper is generated: each op is an
/// opaque deferred operation on the fusion stream). Call it through this module's functions, which
/// check arguments and fall back to plain Burn off CubeCL devices.
#[backend_extension(Cube, Fusion)]
pub trait GpuTimelineOps: Backend {
    /// Records a CUDA event on the stream `anchor`'s work is ordered on, behind everything
    /// enqueued before, into `mark` (see [`crate::mark_stream`]; nothing off CUDA). Returns
    /// `anchor`.
    #[fusion(meta = mark_stream_meta)]
    fn mark_stream(anchor: IntTensor<Self>, mark: MarkSlot) -> IntTensor<Self>;
}

fn mark_stream_meta(anchor: &TensorSpec, _mark: &MarkSlot) -> TensorSpec {
    anchor.clone()
}

impl GpuTimelineOps for CubeBackend {
    fn mark_stream(anchor: IntTensor<Self>, mark: MarkSlot) -> IntTensor<Self> {
        record(&anchor, &mark);
        anchor
    }
}
