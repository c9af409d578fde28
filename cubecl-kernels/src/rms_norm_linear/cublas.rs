//! cuBLASLt for the linear family on CUDA devices: `y [M, N] = x [M, K] · W [N, K]ᵀ (+ b)`.
//!
//! Layout: cuBLAS is column-major, so the product is computed as `yᵀ [N, M] = W · xᵀ`:
//! A = W (`K × N`, ld = W's row pitch, transposed), B = x (`K × M`, ld = x's row pitch),
//! D = y (`N × M`, ld = y's row pitch). The bias is cuBLASLt's BIAS epilogue (one value per row
//! of D: per output feature); an added matrix (`linear_add`'s residual, laid out like y) is C
//! with `beta = 1`. Accumulation and scaling in f32 (`CUBLAS_COMPUTE_32F`: f32 operands are not
//! rounded to TF32).
//!
//! Ordering, two ways, chosen when this crate is built (`build.rs`):
//! - With the vendored cubecl-cuda (vendor/README.md: this workspace, and dependents that add its
//!   `[patch]` lines, README "Library"), whose `GpuResource` carries CubeCL's CUDA stream, the call
//!   is enqueued on that stream from CubeCL's device thread (`Client::exclusive`), after
//!   `get_resource` has made every earlier launch of this thread reach it. It thus runs between our
//!   kernels, is recorded by CUDA-graph capture like them, and never runs on another thread while
//!   a capture is open (CubeCL captures in CUDA's global mode, where a driver call from any other
//!   thread invalidates the capture).
//! - With the published cubecl-cuda, which does not say which stream a buffer's work is on, the
//!   call runs on a stream of ours, fenced by the whole context (CUDA ≥ 12.5): an event recorded
//!   for the context (`cuCtxRecordEvent`: every launch CubeCL made so far) that our stream waits
//!   for, then the product, then an event our stream records and the context waits for
//!   (`cuCtxWaitEvent`: every later launch, on any stream, starts after the product). Both calls
//!   are refused while a stream of the context captures a graph, so under capture (from
//!   `graph_prepare` on: the warm-up runs take the same route as the recorded one) the products
//!   take CubeCL's kernels instead ([`usable`]).
//!
//! Capture rules: cuBLAS gets a 32 MiB workspace per stream, a persistent CubeCL buffer (left to
//! itself it would allocate one inside the graph, which CubeCL rejects; two streams never share
//! one); the handle and each shape's plan (descriptors, layouts, the heuristic's algorithm:
//! `cublas_plan.rs`) are made on first use, which the engine's warm-up runs before any capture.
//!
//! Algorithm choice: cuBLASLt's heuristic ranks its algorithms for a shape without running
//! them, and its first pick is what PyTorch takes. While [`super::set_linear_tuning`] is on (the
//! engine turns it on for the warm-up runs of the steps it captures as graphs, whose shapes then
//! run thousands of times), a shape's first call on CubeCL's stream times the heuristic's top
//! `TUNE_CANDIDATES` (`cublas_plan.rs`) on its own operands (CUDA events, [`TUNE_RUNS`] runs
//! each, after one untimed run) and keeps the fastest; outside it, or when the output aliases an input (a run
//! would not be repeatable), the first pick stays (`BURN_NANOVLLM_CUBLAS_TUNE=off`: always;
//! `=rows`: for shapes of fewer rows). The timed runs find the weights in the L2 cache, where a
//! step streams them from memory; measured on the H100, tuning only shapes of ≥ 512 rows (where
//! the arithmetic, not the weights, sets the time) did no better than tuning all. A
//! batch-invariant shape has one candidate, never timed.

use std::any::Any;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::client::Client;
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver;
use cudarc::driver::sys::{CUevent, CUstream};

use super::cublas_plan::{Fp8ScaleMode, Plan, PlanKey, WORKSPACE_BYTES, set_desc};
use crate::knobs::Knobs;

type CudaServer = <cubecl::cuda::CudaRuntime as cubecl_runtime::runtime::Runtime>::Server;

/// Timed runs of each candidate.
const TUNE_RUNS: usize = 5;

/// cuBLASLt state of one CUDA device.
struct DeviceLt {
    handle: sys::cublasLtHandle_t,
    plans: HashMap<PlanKey, Plan>,
    /// Our stream and its fences, for calls without CubeCL's stream (made on first use).
    fenced: Option<Fenced>,
    /// Timing events for tuning (made on first use).
    timer: Option<[CUevent; 2]>,
}

// SAFETY: the raw handles are only used under the `DEVICES` mutex.
unsafe impl Send for DeviceLt {}

/// Per CUDA device index: its state, or why cuBLASLt cannot serve it.
static DEVICES: Mutex<Vec<(usize, Result<DeviceLt, String>)>> = Mutex::new(Vec::new());

/// CUDA device indices where cuBLASLt's FP8 product is off, and why.
static FP8_OFF: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());

/// The scales of an FP8 product (`crate::fp8_linear`): `w [N]` f32, one per output feature
/// (row of W), and `x [M]` f32, one per row of x; with `per_tensor` every entry of each is the
/// same and cuBLASLt reads their first as scalars.
#[derive(Clone, Copy)]
pub(crate) struct Fp8Scales<'a> {
    pub(crate) w: &'a CubeTensor,
    pub(crate) x: &'a CubeTensor,
    pub(crate) per_tensor: bool,
}

/// Why cuBLASLt's FP8 product (E4M3 operands, per-row scale vectors:
/// `CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F`, cuBLAS ≥ 12.9) does not serve CUDA device
/// `index`: cuBLASLt unavailable, a device of compute capability below 8.9 (no FP8 tensor
/// cores), or an earlier failure of the FP8 product there. `None`: it does, or may.
pub(crate) fn fp8_unavailable_reason(index: usize) -> Option<String> {
    if let Some(reason) = fp8_off_reason(index) {
        return Some(reason);
    }
    match compute_capability(index) {
        Ok((major, minor)) if (major, minor) >= (8, 9) => None,
        Ok((major, minor)) => Some(format!(
            "cuda:{index} has compute capability {major}.{minor}; FP8 tensor cores need 8.9 or \
             later (Ada, Hopper, Blackwell)"
        )),
        Err(e) => Some(format!("cuda:{index}: {e}")),
    }
}

/// Why the FP8 product is off on CUDA device `index` (cuBLASLt unavailable, or an earlier
/// failure of the FP8 product there), without asking the driver: what each product checks
/// (a device without FP8 tensor cores fails its first product and is marked here).
fn fp8_off_reason(index: usize) -> Option<String> {
    if let Some(reason) = cublas_unavailable_reason(index) {
        return Some(format!("cuBLASLt: {reason}"));
    }
    let off = FP8_OFF.lock().unwrap_or_else(|e| e.into_inner());
    off.iter()
        .find(|(i, _)| *i == index)
        .map(|(_, reason)| reason.clone())
}

/// The compute capability `(major, minor)` of CUDA device `index`.
fn compute_capability(index: usize) -> Result<(i32, i32), String> {
    use driver::sys::CUdevice_attribute as A;
    let failed = |e: driver::DriverError| format!("device query: {e:?}");
    driver::result::init().map_err(failed)?;
    let device = driver::result::device::get(index as i32).map_err(failed)?;
    // SAFETY: a valid device handle; only queries.
    unsafe {
        Ok((
            driver::result::device::get_attribute(
                device,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )
            .map_err(failed)?,
            driver::result::device::get_attribute(
                device,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            )
            .map_err(failed)?,
        ))
    }
}

/// A stream's workspace: the persistent buffer (its handle and pinned resource, kept for the
/// process) and its address.
struct Workspace {
    _keep: Box<dyn Any + Send>,
    ptr: u64,
}

/// Workspaces by (device index, stream address).
static WORKSPACES: Mutex<Vec<((usize, usize), Workspace)>> = Mutex::new(Vec::new());

/// The CUDA device index of `device`, if cuBLASLt may serve it: CUDA, the library loadable, not
/// switched off (`BURN_NANOVLLM_CUBLAS=0`), no earlier failure on that device, and without
/// CubeCL's stream ([`stream_ordered`]) no graph capture under way on `client`'s stream.
pub(crate) fn usable(device: &cubecl::Device, client: &Client) -> Option<usize> {
    #[allow(unreachable_patterns)]
    let index = match device {
        cubecl::Device::Cuda(d) => d.index,
        _ => return None,
    };
    if !stream_ordered() && client.is_capturing() {
        return None;
    }
    cublas_unavailable_reason(index).is_none().then_some(index)
}

/// Whether cuBLASLt runs on CubeCL's own stream, so that graph captures record it: built
/// against the vendored cubecl-cuda, which hands the stream out, and not switched to the fenced
/// route (`BURN_NANOVLLM_CUBLAS=fenced`). Otherwise it is fenced by the context and stays out
/// of captures (module doc).
pub fn stream_ordered() -> bool {
    cfg!(cubecl_cuda_stream) && !Knobs::get().cublas_fenced
}

/// Why cuBLASLt does not serve CUDA device `index`, if it does not (`None`: it does, or has not
/// been asked yet).
pub fn cublas_unavailable_reason(index: usize) -> Option<String> {
    if Knobs::get().cublas_off {
        return Some("switched off by BURN_NANOVLLM_CUBLAS=0".into());
    }
    if !library_present() {
        return Some("libcublasLt could not be loaded".into());
    }
    let devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    devices
        .iter()
        .find(|(i, _)| *i == index)
        .and_then(|(_, state)| state.as_ref().err().cloned())
}

fn library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to open the library.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Why a call was not enqueued.
enum Failure {
    /// This call only (the device thread was busy): the next one may succeed.
    Transient(String),
    /// cuBLASLt cannot serve the device.
    Fatal(String),
}

/// Writes `y = x · wᵀ (+ bias) (+ add)` on CUDA device `index`. `x [M, K]`, `w [N, K]`,
/// `y [M, N]`, `add [M, N]` of one dtype (f32, f16 or bf16) with unit inner strides, `bias [N]`.
/// `invariant`: the algorithm is the one chosen for this weight at
/// [`INVARIANT_REFERENCE_ROWS`] rows, without split-K and never timed, whatever `M`
/// ([`crate::ReductionOrder::BatchInvariant`]). With `fp8`, `x` and `w` are E4M3 codes (`U8`)
/// and the product is scaled by their scale vectors (`crate::fp8_linear`). On failure nothing
/// was enqueued and the error is returned, so that the caller can take another path; a failure
/// of cuBLASLt itself also marks the device unusable (of the FP8 product only, with `fp8`; with
/// the reason, printed once).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    index: usize,
    x: &CubeTensor,
    w: &CubeTensor,
    bias: Option<&CubeTensor>,
    add: Option<&CubeTensor>,
    y: &CubeTensor,
    invariant: bool,
    fp8: Option<Fp8Scales<'_>>,
) -> Result<(), String> {
    if fp8.is_some()
        && let Some(reason) = fp8_off_reason(index)
    {
        return Err(reason);
    }
    let is_fp8 = fp8.is_some();
    match enqueue(index, x, w, bias, add, y, invariant, fp8) {
        Ok(()) => Ok(()),
        Err(Failure::Transient(reason)) => Err(reason),
        Err(Failure::Fatal(reason)) if is_fp8 => {
            // The FP8 product alone is off for the device; 16-bit products keep cuBLASLt.
            let mut off = FP8_OFF.lock().unwrap_or_else(|e| e.into_inner());
            if !off.iter().any(|(i, _)| *i == index) {
                eprintln!(
                    "burn-nanovllm: cuBLASLt's FP8 product disabled on cuda:{index}, emulating it: {reason}"
                );
                off.push((index, reason.clone()));
            }
            Err(reason)
        }
        Err(Failure::Fatal(reason)) => {
            let mut devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
            devices.retain(|(i, _)| *i != index);
            devices.push((index, Err(reason.clone())));
            eprintln!(
                "burn-nanovllm: cuBLASLt disabled on cuda:{index}, using CubeCL kernels: {reason}"
            );
            Err(reason)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn enqueue(
    index: usize,
    x: &CubeTensor,
    w: &CubeTensor,
    bias: Option<&CubeTensor>,
    add: Option<&CubeTensor>,
    y: &CubeTensor,
    invariant: bool,
    fp8: Option<Fp8Scales<'_>>,
) -> Result<(), Failure> {
    let (m, k) = (x.meta.shape()[0], x.meta.shape()[1]);
    let n = w.meta.shape()[0];
    let dtype = y.dtype;
    let out_type = match dtype {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        other => return Err(Failure::Fatal(format!("dtype {other:?} is not supported"))),
    };
    let in_type = match fp8 {
        Some(_) => sys::cudaDataType::CUDA_R_8F_E4M3,
        None => out_type,
    };
    // The resources pin their allocations until the call is enqueued; `get_resource` is
    // answered on the device thread after every earlier launch of this thread was issued.
    let resource = |t: &CubeTensor| {
        t.client
            .get_resource::<CudaServer>(t.handle.clone())
            .map_err(|e| Failure::Transient(format!("get_resource: {e:?}")))
    };
    let (xr, wr, yr) = (resource(x)?, resource(w)?, resource(y)?);
    let br = bias.map(resource).transpose()?;
    let ar = add.map(resource).transpose()?;
    let sr = fp8
        .map(|s| Ok::<_, Failure>([resource(s.w)?, resource(s.x)?]))
        .transpose()?;
    // CubeCL's stream where this build can know it (module doc); `None`: our own, fenced.
    #[cfg(cubecl_cuda_stream)]
    let stream = {
        let stream = yr.resource().stream;
        if xr.resource().stream != stream
            || wr.resource().stream != stream
            || ar.as_ref().is_some_and(|a| a.resource().stream != stream)
        {
            return Err(Failure::Transient(
                "operands resolved to different CUDA streams".into(),
            ));
        }
        stream_ordered().then_some(stream)
    };
    #[cfg(not(cubecl_cuda_stream))]
    let stream: Option<CUstream> = None;
    let add_ptr = ar.as_ref().map_or(0, |a| a.resource().ptr);
    let ptrs = [
        xr.resource().ptr,
        wr.resource().ptr,
        yr.resource().ptr,
        add_ptr,
    ];
    let pitch = |t: &CubeTensor, width: usize| t.meta.strides()[0].max(width);
    let key = PlanKey {
        m,
        n,
        k,
        ld: [
            pitch(x, k),
            pitch(w, k),
            pitch(y, n),
            add.map_or(0, |a| pitch(a, n)),
        ],
        align: ptrs.map(|p| {
            if p == 0 {
                0
            } else {
                1usize << p.trailing_zeros().min(8)
            }
        }),
        dtype,
        fp8: fp8.map(|s| {
            if s.per_tensor {
                Fp8ScaleMode::Scalar
            } else {
                Fp8ScaleMode::OuterVectors
            }
        }),
        bias: bias.is_some(),
        invariant,
    };

    let workspace = workspace(index, stream, y).map_err(Failure::Transient)?;
    let call = Call {
        index,
        key,
        types: [in_type, out_type],
        ptrs,
        bias: br.as_ref().map_or(0, |b| b.resource().ptr),
        scales: sr
            .as_ref()
            .map_or([0, 0], |[w, x]| [w.resource().ptr, x.resource().ptr]),
        workspace,
        stream,
    };
    // The resources stay held (their allocations pinned) until the call was enqueued.
    let result = y
        .client
        .exclusive(move || call.enqueue())
        .map_err(|e| Failure::Transient(format!("exclusive: {e:?}")))?;
    drop((xr, wr, yr, br, ar, sr));
    result.map_err(Failure::Fatal)
}

/// The workspace of `stream` (`None`: our fenced stream) on device `index`, allocated
/// (persistent, from `like`'s client) on first use.
fn workspace(index: usize, stream: Option<CUstream>, like: &CubeTensor) -> Result<u64, String> {
    let key = (index, stream.map_or(0, |s| s as usize));
    let mut workspaces = WORKSPACES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, w)) = workspaces.iter().find(|(k, _)| *k == key) {
        return Ok(w.ptr);
    }
    let client = &like.client;
    let handle = client.memory_persistent_allocation((), |()| client.empty(WORKSPACE_BYTES));
    let resource = client
        .get_resource::<CudaServer>(handle.clone())
        .map_err(|e| format!("workspace: {e:?}"))?;
    let ptr = resource.resource().ptr;
    workspaces.push((
        key,
        Workspace {
            _keep: Box::new((handle, resource)),
            ptr,
        },
    ));
    Ok(ptr)
}

/// One cuBLASLt call, run on CubeCL's device thread.
struct Call {
    index: usize,
    key: PlanKey,
    /// The operands' and the output's data types.
    types: [sys::cudaDataType; 2],
    /// Addresses of x, W, y and the added matrix (0: none).
    ptrs: [u64; 4],
    /// Address of the bias (0: none).
    bias: u64,
    /// Addresses of an FP8 product's scales: W's per output feature, x's per row.
    scales: [u64; 2],
    workspace: u64,
    /// CubeCL's stream, or `None` for our fenced one.
    stream: Option<CUstream>,
}

// SAFETY: the stream handle is only passed to cuBLASLt, on the device thread that owns it.
unsafe impl Send for Call {}

impl Call {
    fn enqueue(self) -> Result<(), String> {
        let Self {
            index,
            key,
            types,
            ptrs,
            bias,
            scales,
            workspace,
            stream,
        } = self;
        let mut devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
        if !devices.iter().any(|(i, _)| *i == index) {
            devices.push((index, DeviceLt::new()));
        }
        let state = devices
            .iter_mut()
            .find(|(i, _)| *i == index)
            .map(|(_, s)| s)
            .expect("inserted above");
        let DeviceLt {
            handle,
            plans,
            fenced,
            timer,
        } = state.as_mut().map_err(|e| e.clone())?;
        let handle = *handle;
        let plan = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Plan::new(handle, &key, types, scales)?)
            }
        };
        let alpha = 1.0f32;
        let (beta, c_ptr, c_layout) = match plan.c {
            Some(c) => (1.0f32, ptrs[3], c),
            None => (0.0f32, ptrs[2], plan.d),
        };
        let PlanKey { m, n, k, .. } = key;
        // SAFETY: the descriptors are alive (owned by the plan); the caller holds the operands'
        // resources until this returns; the shapes and pitches are the ones the layouts
        // describe; the workspace belongs to this stream and is as large as the heuristic was
        // told.
        let matmul = |algo: &sys::cublasLtMatmulAlgo_t, stream: CUstream| unsafe {
            if key.bias {
                set_desc(
                    plan.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &(bias as *const c_void),
                )?;
            }
            if key.fp8.is_some() {
                // cuBLASLt's A is W (a scale per output feature), its B is x (one per row); as
                // scalars, the vectors' first entries.
                use sys::cublasLtMatmulDescAttributes_t as A;
                set_desc(
                    plan.desc,
                    A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                    &(scales[0] as *const c_void),
                )?;
                set_desc(
                    plan.desc,
                    A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                    &(scales[1] as *const c_void),
                )?;
            }
            lt::matmul(
                handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                ptrs[1] as *const c_void,
                plan.a,
                ptrs[0] as *const c_void,
                plan.b,
                c_ptr as *const c_void,
                c_layout,
                ptrs[2] as *mut c_void,
                plan.d,
                algo,
                workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream as _,
            )
            .map_err(|e| format!("cublasLtMatmul {m}x{n}x{k}: {e:?}"))
        };
        match stream {
            Some(stream) => {
                // The output is rewritten by every run and no input is it: timed runs repeat.
                let repeatable = ptrs[2] != ptrs[0] && ptrs[2] != ptrs[3];
                if !plan.tuned
                    && plan.candidates.len() > 1
                    && repeatable
                    && super::linear_tuning()
                    && m >= Knobs::get().cublas_tune_min_rows.unwrap_or(0)
                    && !capturing(stream)
                {
                    if timer.is_none() {
                        *timer = Some(timing_events()?);
                    }
                    let events = timer.expect("made above");
                    let fastest = fastest(&plan.candidates, events, stream, |algo| {
                        matmul(algo, stream)
                    })?;
                    plan.algo = plan.candidates[fastest];
                    plan.tuned = true;
                }
                matmul(&plan.algo, stream)
            }
            None => {
                if fenced.is_none() {
                    *fenced = Some(Fenced::new()?);
                }
                fenced
                    .as_ref()
                    .expect("created above")
                    .run(|stream| matmul(&plan.algo, stream))
            }
        }
    }
}

/// Whether `stream` is capturing a graph (where nothing may wait for it).
fn capturing(stream: CUstream) -> bool {
    use driver::sys as d;
    let mut status = d::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: on the device thread, `stream` alive; only queries.
    let queried = unsafe { d::cuStreamIsCapturing(stream, &mut status) };
    queried.result().is_err() || status != d::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
}

/// Two events with timing, for [`fastest`].
fn timing_events() -> Result<[CUevent; 2], String> {
    let event = || {
        driver::result::event::create(driver::sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| format!("cuEventCreate: {e:?}"))
    };
    Ok([event()?, event()?])
}

/// Index of the candidate whose runs take least time on `stream`, where `run` enqueues them:
/// one untimed run each, then [`TUNE_RUNS`] between `events`, waited for. A candidate that
/// fails to run is passed over; the first is kept if every other does.
fn fastest(
    candidates: &[sys::cublasLtMatmulAlgo_t],
    [start, end]: [CUevent; 2],
    stream: CUstream,
    run: impl Fn(&sys::cublasLtMatmulAlgo_t) -> Result<(), String>,
) -> Result<usize, String> {
    let failed = |e: driver::DriverError| format!("tuning: {e:?}");
    let mut best = (0, f32::INFINITY);
    for (i, algo) in candidates.iter().enumerate() {
        if run(algo).is_err() {
            continue;
        }
        // SAFETY: the events and the stream are alive, on the device thread.
        let time = unsafe {
            driver::result::event::record(start, stream).map_err(failed)?;
            let ran = (0..TUNE_RUNS).all(|_| run(algo).is_ok());
            driver::result::event::record(end, stream).map_err(failed)?;
            driver::result::event::synchronize(end).map_err(failed)?;
            let ms = driver::result::event::elapsed(start, end).map_err(failed)?;
            ran.then_some(ms)
        };
        if let Some(t) = time.filter(|&t| t < best.1) {
            best = (i, t);
        }
    }
    Ok(best.0)
}

/// Our stream for cuBLASLt where CubeCL's is unknown, and the events that fence it against the
/// whole context (module doc). Created on the device thread, kept for the process.
struct Fenced {
    stream: CUstream,
    /// Recorded for the context before a call; our stream waits for it.
    before: CUevent,
    /// Recorded on our stream after a call; the context waits for it.
    after: CUevent,
}

impl Fenced {
    fn new() -> Result<Self, String> {
        let err = |what: &str, e: &dyn std::fmt::Debug| format!("{what}: {e:?}");
        let flags = driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        Ok(Self {
            stream: driver::result::stream::create(driver::result::stream::StreamKind::NonBlocking)
                .map_err(|e| err("cuStreamCreate", &e))?,
            before: driver::result::event::create(flags).map_err(|e| err("cuEventCreate", &e))?,
            after: driver::result::event::create(flags).map_err(|e| err("cuEventCreate", &e))?,
        })
    }

    /// Runs `call` on our stream after every launch CubeCL made so far, and makes every later
    /// launch of the context wait for it. Fails where the driver lacks context events (CUDA
    /// < 12.5) or while a stream of the context captures.
    fn run(&self, call: impl FnOnce(CUstream) -> Result<(), String>) -> Result<(), String> {
        use driver::sys as d;
        let check = |what: &str, r: d::CUresult| {
            r.result().map_err(|e| format!("{what}: {e:?} (cuBLASLt without CubeCL's stream needs CUDA 12.5's context events)"))
        };
        // SAFETY: on the device thread, where CubeCL's context is current; the stream and
        // events are ours and alive.
        unsafe {
            let mut ctx = std::ptr::null_mut();
            check("cuCtxGetCurrent", d::cuCtxGetCurrent(&mut ctx))?;
            check("cuCtxRecordEvent", d::cuCtxRecordEvent(ctx, self.before))?;
            check(
                "cuStreamWaitEvent",
                d::cuStreamWaitEvent(self.stream, self.before, 0),
            )?;
            call(self.stream)?;
            check("cuEventRecord", d::cuEventRecord(self.after, self.stream))?;
            check("cuCtxWaitEvent", d::cuCtxWaitEvent(ctx, self.after))
        }
    }
}

impl DeviceLt {
    /// Runs on the device thread, where CubeCL's context is current.
    fn new() -> Result<Self, String> {
        let handle = lt::create_handle().map_err(|e| format!("cublasLtCreate: {e:?}"))?;
        Ok(Self {
            handle,
            plans: HashMap::new(),
            fenced: None,
            timer: None,
        })
    }
}
