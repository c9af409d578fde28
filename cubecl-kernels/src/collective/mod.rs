//! NCCL collectives on CubeCL's CUDA stream, for tensor parallelism (one process per GPU).
//!
//! Layout: a communicator ([`NcclComm`]) per process, made from one [`NcclId`] that rank 0
//! creates and hands to the others (any byte channel: a pipe, an environment variable, TCP
//! across hosts). [`all_reduce_sum`] sums a tensor over the ranks in place: the call is an op of
//! the fusion stream, enqueued from CubeCL's device thread (`Client::exclusive`) on the stream
//! of the tensor's work, as the cuBLASLt products are (`rms_norm_linear/cublas.rs`), so it runs
//! between our kernels and a CUDA-graph capture records it. That needs the vendored
//! cubecl-cuda, which hands the stream out; built against the published crate the op is
//! refused. Every rank must issue the same collectives in the same order (NCCL's contract); a
//! rank that stops makes the others wait, which the engine's watchdog bounds.
//!
//! Sums of up to a few MB take the group's own kernels instead of NCCL's ([`peer`]: every rank
//! writes its data into its peers' buffers through CUDA IPC), where the group could set them
//! up; `BURN_NANOVLLM_ALL_REDUCE=nccl` keeps NCCL for every size.

mod peer;

pub use peer::AllReduceKernel;

use std::fmt;
use std::sync::Arc;

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cudarc::nccl::{result as nccl, sys};

use crate::KernelError;
use crate::knobs::Knobs;
#[cfg(cubecl_cuda_stream)]
use peer::Elem;
use peer::PeerBuffers;

#[cfg(cubecl_cuda_stream)]
type CudaServer = <cubecl::cuda::CudaRuntime as cubecl_runtime::runtime::Runtime>::Server;

/// The 128-byte id that names one NCCL group: made once by rank 0, read by every rank.
#[derive(Clone, Copy)]
pub struct NcclId(sys::ncclUniqueId);

impl NcclId {
    /// A fresh id (NCCL's bootstrap: no GPU needed).
    pub fn new() -> Result<Self, KernelError> {
        nccl::get_uniqueid()
            .map(Self)
            .map_err(|e| KernelError::invalid(format!("ncclGetUniqueId: {e:?}")))
    }

    /// The id as hex text (256 characters), to pass to other processes.
    pub fn to_hex(&self) -> String {
        self.0
            .internal
            .iter()
            .map(|&b| format!("{:02x}", b as u8))
            .collect()
    }

    /// The id from [`NcclId::to_hex`]'s text.
    pub fn from_hex(hex: &str) -> Result<Self, KernelError> {
        let bad = || KernelError::invalid(format!("not an NCCL id: {hex:?}"));
        let bytes = hex.as_bytes();
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        if bytes.len() != 2 * id.internal.len() {
            return Err(bad());
        }
        for (i, slot) in id.internal.iter_mut().enumerate() {
            let text = std::str::from_utf8(&bytes[2 * i..2 * i + 2]).map_err(|_| bad())?;
            *slot = u8::from_str_radix(text, 16).map_err(|_| bad())? as _;
        }
        Ok(Self(id))
    }
}

impl fmt::Debug for NcclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NcclId({}…)", &self.to_hex()[..16])
    }
}

/// This process's member of an NCCL group, on one CUDA device. Never destroyed:
/// `ncclCommDestroy` finalizes with the peers (gone by the time it would run), and
/// `ncclCommAbort` blocked rank 0's shutdown on 2 × H200 (measured); the process's exit
/// releases the communicator's buffers.
pub struct NcclComm {
    comm: sys::ncclComm_t,
    rank: usize,
    size: usize,
    aborted: std::sync::atomic::AtomicBool,
    reason: std::sync::Mutex<String>,
    /// The group's IPC buffers and kernels for sums up to a few MB (absent: NCCL for all).
    peer: Option<PeerBuffers>,
    /// Sums of every size through the IPC kernels (in pieces), for one summation order.
    #[cfg_attr(not(cubecl_cuda_stream), allow(dead_code))]
    fixed_order: std::sync::atomic::AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; every call is made from CubeCL's device thread inside `Client::exclusive`.
unsafe impl Send for NcclComm {}
// SAFETY: as above; shared references only enqueue through `Client::exclusive`.
unsafe impl Sync for NcclComm {}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NcclComm(rank {} of {})", self.rank, self.size)
    }
}

impl NcclComm {
    /// Joins group `id` as `rank` of `size` on CUDA device `index` (as CubeCL numbers them; a
    /// process should see only its own GPU), and sets up the group's IPC buffers for small sums
    /// with the other ranks. Blocks until every rank has joined.
    pub fn join(
        id: NcclId,
        rank: usize,
        size: usize,
        index: usize,
    ) -> Result<Arc<Self>, KernelError> {
        if rank >= size {
            return Err(KernelError::invalid(format!(
                "rank {rank} is outside 0..{size}"
            )));
        }
        // The communicator is made on CubeCL's device thread, with its CUDA context current.
        let client = <cubecl::cuda::CudaRuntime as cubecl_runtime::runtime::Runtime>::client(
            &cubecl::cuda::CudaDevice { index },
        );
        let with_peers = !Knobs::get().all_reduce_nccl_only;
        let (made, peer) = client
            .exclusive(move || {
                let mut comm = std::ptr::null_mut();
                // SAFETY: `comm` is a valid out-pointer; the id is shared by all ranks.
                unsafe { nccl::comm_init_rank(&mut comm, size as i32, id.0, rank as i32) }
                    .map_err(|e| format!("ncclCommInitRank: {e:?}"))?;
                let peer = match with_peers {
                    // SAFETY: the communicator was just made, on this thread.
                    true => unsafe { PeerBuffers::exchange(comm, rank, size)? },
                    false => None,
                };
                Ok::<_, String>((comm as usize, peer))
            })
            .map_err(|e| KernelError::invalid(format!("exclusive: {e:?}")))?
            .map_err(KernelError::invalid)?;
        Ok(Arc::new(Self {
            comm: made as sys::ncclComm_t,
            rank,
            size,
            aborted: std::sync::atomic::AtomicBool::new(false),
            reason: std::sync::Mutex::new(String::new()),
            peer,
            fixed_order: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether sums of up to a few MB take the group's own IPC kernels rather than NCCL.
    pub fn has_peer_all_reduce(&self) -> bool {
        self.peer.is_some()
    }

    /// With `fixed`, sums larger than the IPC kernels' buffers go through them in pieces
    /// instead of through NCCL, so that every element is summed in rank order in f32 whatever
    /// the message's size (batch-invariant inference). Without the IPC kernels, NCCL's order
    /// stays (fixed for one size, not across sizes). Every rank must set the same.
    pub fn set_fixed_order(&self, fixed: bool) {
        self.fixed_order
            .store(fixed, std::sync::atomic::Ordering::Release);
    }

    /// Ends the group (a peer died or this rank failed, `reason`): later collectives are
    /// refused at once, and NCCL is told to abort the ones in flight, on a thread of its own
    /// (the abort may wait for the device); returns at once.
    pub fn abort(&self, reason: &str) {
        if self.aborted.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        *self.reason.lock().unwrap_or_else(|e| e.into_inner()) = reason.to_string();
        if let Some(peer) = &self.peer {
            peer.abort();
        }
        let comm = self.comm as usize;
        std::thread::spawn(move || {
            // SAFETY: communicators are never destroyed (type doc), and this one is aborted
            // once (the flag).
            unsafe {
                let _ = nccl::comm_abort(comm as sys::ncclComm_t);
            }
        });
    }

    #[cfg_attr(not(cubecl_cuda_stream), allow(dead_code))]
    fn abort_reason(&self) -> String {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// The reduction of a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// Element-wise sum.
    Sum,
    /// Element-wise minimum.
    Min,
}

/// The communicator and reduction of a [`CollectiveOps::all_reduce`] op.
#[derive(Clone, Debug)]
pub struct CommSlot(pub Arc<NcclComm>, pub Reduction);

/// `x [M, N]` (bf16, f16 or f32, contiguous) summed over `comm`'s ranks, in place: the returned
/// tensor is `x`'s buffer. A CUDA device and the vendored cubecl-cuda are required.
pub fn all_reduce_sum(x: Tensor<2>, comm: &Arc<NcclComm>) -> Result<Tensor<2>, KernelError> {
    all_reduce(x, comm, Reduction::Sum)
}

/// `x [M, N]` reduced over `comm`'s ranks by `reduction`, in place (see [`all_reduce_sum`]).
/// The collective is flushed to the device's stream before this returns (without waiting for
/// the device), so that every rank issues its collectives in call order.
pub fn all_reduce(
    x: Tensor<2>,
    comm: &Arc<NcclComm>,
    reduction: Reduction,
) -> Result<Tensor<2>, KernelError> {
    if !matches!(x.dtype(), DType::BF16 | DType::F16 | DType::F32) {
        return Err(KernelError::invalid(format!(
            "all_reduce_sum: dtype {:?} (bf16, f16 or f32)",
            x.dtype()
        )));
    }
    let on_cuda = matches!(
        x.device().as_dispatch(),
        burn::backend::DispatchDevice::Cube(cubecl::Device::Cuda(_))
    );
    if !on_cuda {
        return Err(KernelError::invalid(format!(
            "all_reduce_sum: {:?} is not a CUDA device",
            x.device()
        )));
    }
    if !cfg!(cubecl_cuda_stream) {
        return Err(KernelError::invalid(
            "all_reduce_sum needs the vendored cubecl-cuda (the stream of CubeCL's work)",
        ));
    }
    let device = x.device();
    let out = Tensor::from_dispatch(Dispatch::all_reduce(
        x.into_dispatch(),
        CommSlot(comm.clone(), reduction),
    ));
    // A collective is enqueued when it is called, never left in the fusion queue: every rank
    // must issue its collectives in the same order, and a rank that has nothing to read next
    // never flushes its queue (a worker's sampling exchange waited there for a next step that
    // rank 0 could not send before the exchange completed: both ranks hung).
    Dispatch::flush(device.as_dispatch())
        .map_err(|e| KernelError::invalid(format!("all_reduce: flush: {e:?}")))?;
    Ok(out)
}

/// The reduction over ranks as a Burn backend extension (an opaque op of the fusion stream).
#[backend_extension(Cube, Fusion)]
pub trait CollectiveOps: Backend {
    /// `x` reduced over the ranks of `comm.0` by `comm.1`, in place; returns `x`.
    #[fusion(meta = all_reduce_meta)]
    fn all_reduce(x: FloatTensor<Self>, comm: CommSlot) -> FloatTensor<Self>;
}

fn all_reduce_meta(x: &TensorSpec, _comm: &CommSlot) -> TensorSpec {
    x.clone()
}

impl CollectiveOps for CubeBackend {
    fn all_reduce(x: FloatTensor<Self>, comm: CommSlot) -> FloatTensor<Self> {
        let x = burn_cubecl::kernel::into_contiguous(x);
        if let Err(e) = enqueue_all_reduce(&x, &comm.0, comm.1) {
            panic!("all_reduce: {e}");
        }
        x
    }
}

/// Refused without the vendored cubecl-cuda: the stream of CubeCL's work is unknown.
#[cfg(not(cubecl_cuda_stream))]
fn enqueue_all_reduce(_: &CubeTensor, _: &Arc<NcclComm>, _: Reduction) -> Result<(), String> {
    Err("the stream of CubeCL's work is unknown (published cubecl-cuda)".into())
}

/// Enqueues `ncclAllReduce(x, x, reduction)` on the stream of `x`'s work.
#[cfg(cubecl_cuda_stream)]
fn enqueue_all_reduce(
    x: &CubeTensor,
    comm: &Arc<NcclComm>,
    reduction: Reduction,
) -> Result<(), String> {
    if comm.aborted.load(std::sync::atomic::Ordering::Acquire) {
        return Err(format!("the group was aborted: {}", comm.abort_reason()));
    }
    let (data_type, elem) = match x.dtype {
        DType::BF16 => (sys::ncclDataType_t::ncclBfloat16, Elem::Bf16),
        DType::F16 => (sys::ncclDataType_t::ncclFloat16, Elem::F16),
        DType::F32 => (sys::ncclDataType_t::ncclFloat32, Elem::F32),
        other => return Err(format!("dtype {other:?}")),
    };
    let count = x.meta.shape().num_elements();
    let resource = x
        .client
        .get_resource::<CudaServer>(x.handle.clone())
        .map_err(|e| format!("get_resource: {e:?}"))?;
    let ptr = resource.resource().ptr;
    let stream = resource.resource().stream as usize;
    let bytes = count * x.dtype.size();
    let group = comm.clone();
    let fixed_order = comm.fixed_order.load(std::sync::atomic::Ordering::Acquire);
    let result = x
        .client
        .exclusive(move || {
            if let (Some(peer), Reduction::Sum) = (&group.peer, reduction) {
                // SAFETY: on the device thread; `ptr` is `bytes` bytes pinned by `resource`
                // until the kernel is enqueued; every rank makes the same calls in order.
                if unsafe { peer.enqueue(ptr, bytes, elem, stream as _, fixed_order)? } {
                    return Ok(());
                }
            }
            // SAFETY: `ptr` is `count` elements of `data_type`, pinned by `resource` until the
            // call is enqueued; the communicator outlives the call (held by the op).
            unsafe {
                nccl::all_reduce(
                    ptr as *const std::ffi::c_void,
                    ptr as *mut std::ffi::c_void,
                    count,
                    data_type,
                    match reduction {
                        Reduction::Sum => sys::ncclRedOp_t::ncclSum,
                        Reduction::Min => sys::ncclRedOp_t::ncclMin,
                    },
                    group.comm,
                    stream as sys::cudaStream_t,
                )
            }
            .map(|_| ())
            .map_err(|e| format!("ncclAllReduce: {e:?}"))
        })
        .map_err(|e| format!("exclusive: {e:?}"))?;
    drop(resource);
    result
}
