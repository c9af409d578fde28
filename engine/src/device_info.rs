//! What the CUDA driver says of a device: its free and total memory, its name. Asked by the
//! batch defaults (`config`), the KV pool's sizing (`memory`) and the graph captures.

/// `(free, total)` bytes of CUDA device `index`, from the driver (`cuMemGetInfo`).
#[cfg(feature = "cuda")]
pub fn cuda_memory(index: usize) -> Option<(usize, usize)> {
    use cudarc::driver::result;
    result::init().ok()?;
    let dev = result::device::get(index as i32).ok()?;
    // SAFETY: the primary context of an existing device, retained (never released: it lives as
    // long as the process, like CubeCL's own) and made current on this thread only to query.
    unsafe {
        let ctx = result::primary_ctx::retain(dev).ok()?;
        result::ctx::set_current(ctx).ok()?;
    }
    result::mem_get_info().ok()
}

/// Without the CUDA runtime there is nothing to ask.
#[cfg(not(feature = "cuda"))]
pub fn cuda_memory(_index: usize) -> Option<(usize, usize)> {
    None
}

/// The name of CUDA device `index` ("NVIDIA H100 80GB HBM3"), from the driver.
#[cfg(feature = "cuda")]
pub fn cuda_device_name(index: usize) -> Option<String> {
    use cudarc::driver::result;
    result::init().ok()?;
    result::device::get_name(result::device::get(index as i32).ok()?).ok()
}

/// Without the CUDA runtime there is nothing to ask.
#[cfg(not(feature = "cuda"))]
pub fn cuda_device_name(_index: usize) -> Option<String> {
    None
}
