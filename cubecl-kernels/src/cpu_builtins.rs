//! Compiler-runtime functions that kernels JIT-compiled by CubeCL's CPU runtime may call.
//!
//! LLVM lowers `fptrunc float to bfloat` to a call of `__truncsfbf2` on x86 CPUs without
//! AVX512-BF16. CubeCL's JIT (LLVM's LLJIT) resolves such calls in the process's global symbol
//! scope — the executable's *dynamic* symbols and the libraries loaded with `RTLD_GLOBAL` —
//! where neither Rust's compiler-builtins nor GCC 12's libgcc provide it, so every bf16 kernel
//! would fail to link there ("Symbols not found: [ __truncsfbf2 ]"). A function of this crate
//! would not do: an executable exports its symbols only when its own link line says so, which a
//! library cannot add for its dependents. So `build.rs` compiles `builtins/cpu_builtins.rs`
//! into a 4 KiB shared library, embedded here, and [`load`] hands it to the dynamic loader
//! (`RTLD_GLOBAL`, from an in-memory file) before the first bf16 kernel compiles: any
//! executable that depends on this crate runs bf16 on `cubecl-cpu`, with a plain dependency
//! line and whatever CPU it runs on.

use std::sync::OnceLock;

use crate::KernelError;

/// The names the library defines, each checked after loading.
const SYMBOLS: [&std::ffi::CStr; 1] = [c"__truncsfbf2"];

#[cfg(cpu_builtins_library)]
static LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libcpu_builtins.so"));

/// Makes the compiler-runtime functions that CubeCL's CPU JIT may call resolvable in this
/// process (once; later calls return the first outcome). Where the process already has them,
/// nothing is loaded.
pub fn load() -> Result<(), KernelError> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            if missing().is_none() {
                return Ok(());
            }
            load_library()?;
            match missing() {
                None => Ok(()),
                Some(name) => Err(format!(
                    "{name:?} still unresolved after loading the library"
                )),
            }
        })
        .clone()
        .map_err(|e| {
            KernelError::invalid(format!(
                "bf16 on cubecl-cpu: this CPU lacks AVX512-BF16, so CubeCL's JIT converts f32 \
                 to bf16 through `__truncsfbf2`, and the library that provides it could not be \
                 loaded: {e} (use f32 on this host)"
            ))
        })
}

/// What bf16 kernels on the CPU runtime need on this host: nothing on CPUs with AVX512-BF16
/// (LLVM converts natively), [`load`] elsewhere.
pub(crate) fn bf16_support() -> Result<(), KernelError> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bf16") {
        return Ok(());
    }
    load()
}

/// The first name of [`SYMBOLS`] the process's global scope does not resolve.
fn missing() -> Option<&'static std::ffi::CStr> {
    // SAFETY: lookups of NUL-terminated names in the global scope.
    SYMBOLS
        .into_iter()
        .find(|name| unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()).is_null() })
}

/// Writes the embedded library to an anonymous in-memory file and opens it with `RTLD_GLOBAL`.
#[cfg(cpu_builtins_library)]
fn load_library() -> Result<(), String> {
    use std::io::Write;
    use std::os::fd::FromRawFd;

    // SAFETY: a NUL-terminated name and no flags; the descriptor is owned by `file` below.
    let fd = unsafe { libc::memfd_create(c"cubecl-cpu-builtins".as_ptr(), 0) };
    if fd < 0 {
        return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(LIBRARY)
        .map_err(|e| format!("writing the library: {e}"))?;
    let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL");
    // SAFETY: the path names the library just written; it has no initialisers beyond the
    // loader's own. The handle is never closed: the JIT may call into it at any time.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a message owned by the loader, or null.
        let why = unsafe { libc::dlerror() };
        let why = if why.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: a NUL-terminated message from the loader.
            unsafe { std::ffi::CStr::from_ptr(why) }
                .to_string_lossy()
                .into_owned()
        };
        return Err(format!("dlopen: {why}"));
    }
    Ok(())
}

#[cfg(not(cpu_builtins_library))]
fn load_library() -> Result<(), String> {
    Err(
        "this build has no builtins library (its build script could not compile it, or the \
         target is not x86-64 Linux)"
            .into(),
    )
}
