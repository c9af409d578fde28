//! The CPU runtime's builtins library (`src/cpu_builtins.rs`): after `load_cpu_builtins`, the
//! process's global scope — where CubeCL's JIT resolves calls — has `__truncsfbf2`, and it
//! rounds f32 to bf16 exactly as `half` does, NaN, infinities, subnormals and ties included.
//! This test's executable does not export the function itself, so on every host it checks the
//! library that bf16 kernels load on CPUs without AVX512-BF16.

use rand::{Rng, SeedableRng, rngs::StdRng};

#[test]
fn truncsfbf2_loads_and_rounds_to_nearest_even() {
    if !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
        eprintln!("skipped: the library is built for x86-64 Linux");
        return;
    }
    cubecl_kernels::load_cpu_builtins().unwrap();
    // SAFETY: a lookup of a NUL-terminated name in the global scope.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"__truncsfbf2".as_ptr()) };
    assert!(!f.is_null(), "__truncsfbf2 is not in the global scope");
    // SAFETY: the library defines it with this signature (x86-64: bf16 in xmm0's low bits).
    let trunc: extern "C" fn(f32) -> f32 = unsafe { std::mem::transmute(f) };
    let mut rng = StdRng::seed_from_u64(7);
    let special = [
        0.0f32,
        -0.0,
        1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x3f80_8000), // a tie: rounds to even (down)
        f32::from_bits(0x3f81_8000), // a tie: rounds to even (up)
        f32::from_bits(0x7f7f_ffff), // rounds up to infinity
    ];
    let random = (0..200_000).map(|_| f32::from_bits(rng.random::<u32>()));
    for x in special.into_iter().chain(random) {
        let got = trunc(x).to_bits();
        let want = u32::from(half::bf16::from_f32(x).to_bits());
        assert_eq!(got, want, "__truncsfbf2({x:e} = {:#010x})", x.to_bits());
    }
}
