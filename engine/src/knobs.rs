//! Environment knobs for benchmarks: alternative engine behaviours, so that one binary measures
//! its variants in one device command. All of them are read once, here, into [`Knobs`].

use std::sync::OnceLock;

/// Every benchmark knob of the engine, as set in the environment at first use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Knobs {
    /// `BURN_NANOVLLM_DECODE_ORDER=arrival`: decode rows in arrival order instead of longest
    /// context first.
    pub arrival_order: bool,
    /// `BURN_NANOVLLM_TP_LOGITS=gather`: tensor-parallel ranks with a split vocabulary gather
    /// every step's logits instead of exchanging each shard's draw.
    pub gather_logits: bool,
}

impl Knobs {
    /// The knobs of this process (read from the environment on the first call).
    pub(crate) fn get() -> &'static Knobs {
        static KNOBS: OnceLock<Knobs> = OnceLock::new();
        KNOBS.get_or_init(|| {
            let is = |var: &str, value: &str| std::env::var(var).is_ok_and(|v| v == value);
            Knobs {
                arrival_order: is("BURN_NANOVLLM_DECODE_ORDER", "arrival"),
                gather_logits: is("BURN_NANOVLLM_TP_LOGITS", "gather"),
            }
        })
    }
}
