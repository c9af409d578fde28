//! [`ReductionOrder`]: whether the kernels may change a row's reduction order with the batch.

/// How the kernels reduce: the linear family along `K` (`x [M, K] · W [N, K]ᵀ`), decode
/// attention along a context's keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReductionOrder {
    /// Each launch takes the fastest route and split for its batch: the order in which a row's
    /// sums are taken may change with the number of rows, and so may their last bits.
    #[default]
    Fastest,
    /// One route and one reduction order per row whatever the batch: a row's result does not
    /// depend on the other rows of the call (batch-invariant inference). Products keep one
    /// cuBLASLt algorithm per weight shape without split-K (elsewhere the FMA-tiled kernel);
    /// decode attention cuts each context by its own length alone; prefill attention's
    /// tensor-core tile is shaped for one query row per sequence (decode rows sent through it).
    BatchInvariant,
}
