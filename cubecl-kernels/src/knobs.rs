//! Environment knobs for benchmarks: alternative launch layouts and forced kernel paths, so that
//! one binary measures its variants in one device command. Each call site reads its knob once
//! (`OnceLock`); these helpers only parse.

/// True if `name` is set (to anything).
pub(crate) fn is_set(name: &str) -> bool {
    std::env::var_os(name).is_some()
}

/// `name=a,b,…` with exactly `N` unsigned integers, else `None`.
pub(crate) fn numbers<const N: usize>(name: &str) -> Option<[usize; N]> {
    let text = std::env::var(name).ok()?;
    let values: Vec<usize> = text
        .split(',')
        .map(|x| x.trim().parse().ok())
        .collect::<Option<_>>()?;
    values.try_into().ok()
}
