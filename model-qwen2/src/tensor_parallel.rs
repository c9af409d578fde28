//! Tensor parallelism of a Qwen2/Qwen3 layer (Megatron's split, as nano-vLLM and vLLM do it):
//! q/k/v and gate/up split by output columns (each merged part separately, biases too),
//! o_proj and down by input columns, each followed by one all-reduce of the partial products
//! (the residual added once, by rank 0). Query heads split evenly; key/value heads split when
//! they divide by the size, else replicated (each rank keeps the head its query heads read, as
//! vLLM does: Qwen2-0.5B has 2 KV heads). The embedding and the LM head are whole on every rank
//! (every rank computes the same logits), or with [`Parallel::vocab_parallel`] split by
//! vocabulary rows, as vLLM's `VocabParallelEmbedding` and `ParallelLMHead`: each rank looks up
//! the ids of its rows (zeros for the others) and one all-reduce sums the embeddings; each rank
//! computes its columns of the logits, which the sampler draws from without gathering them
//! (see `cubecl_kernels::sample_shard`), or [`Parallel::gather_vocab`] gathers.

use std::fmt::Debug;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};

use burn::tensor::{Tensor, TensorData};

use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};

/// One rank of a tensor-parallel group: `rank` in `0..size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpRank {
    /// This process's (or thread's) place in the group.
    pub rank: usize,
    /// Ranks in the group (the tensor-parallel size).
    pub size: usize,
}

impl TpRank {
    /// The whole model on one device.
    pub const SINGLE: Self = Self { rank: 0, size: 1 };

    /// Rank `rank` of `size`, checked against `config`: the query heads and the intermediate
    /// size must divide by `size`, and the key/value heads divide by it or it by them; an
    /// error names the field that does not.
    pub fn new(rank: usize, size: usize, config: &Qwen2Config) -> Result<Self> {
        let bad = |field: &str, value: usize, reason: String| ModelError::Unsupported {
            field: field.into(),
            value: value.to_string(),
            reason,
        };
        if size == 0 || rank >= size {
            return Err(bad(
                "tensor_parallel_size",
                size,
                format!("rank {rank} is outside 0..{size}"),
            ));
        }
        let c = config;
        if !c.num_attention_heads.is_multiple_of(size) {
            return Err(bad(
                "num_attention_heads",
                c.num_attention_heads,
                format!("tensor_parallel_size {size} must divide it"),
            ));
        }
        let kv = c.num_key_value_heads;
        if !kv.is_multiple_of(size) && !size.is_multiple_of(kv) {
            return Err(bad(
                "num_key_value_heads",
                kv,
                format!("tensor_parallel_size {size} must divide it or be a multiple of it"),
            ));
        }
        if c.vocab_size < size {
            return Err(bad(
                "vocab_size",
                c.vocab_size,
                format!("tensor_parallel_size {size} must not exceed it"),
            ));
        }
        if !c.intermediate_size.is_multiple_of(size) {
            return Err(bad(
                "intermediate_size",
                c.intermediate_size,
                format!("tensor_parallel_size {size} must divide it"),
            ));
        }
        Ok(Self { rank, size })
    }

    /// This rank's query heads.
    pub fn heads(&self, c: &Qwen2Config) -> Range<usize> {
        let n = c.num_attention_heads / self.size;
        self.rank * n..(self.rank + 1) * n
    }

    /// This rank's key/value heads: a split of them, or the one head its query heads read
    /// when there are fewer heads than ranks.
    pub fn kv_heads(&self, c: &Qwen2Config) -> Range<usize> {
        let kv = c.num_key_value_heads;
        if kv >= self.size {
            let n = kv / self.size;
            self.rank * n..(self.rank + 1) * n
        } else {
            let head = self.rank / (self.size / kv);
            head..head + 1
        }
    }

    /// This rank's columns of the MLP's intermediate activation.
    pub fn intermediate(&self, c: &Qwen2Config) -> Range<usize> {
        let n = c.intermediate_size / self.size;
        self.rank * n..(self.rank + 1) * n
    }

    /// This rank's tokens of the vocabulary (its rows of the embedding and of the LM head): the
    /// first `V mod size` ranks take `⌊V/size⌋ + 1` tokens, the others `⌊V/size⌋`, in order.
    pub fn vocab(&self, c: &Qwen2Config) -> Range<usize> {
        let (n, extra) = (c.vocab_size / self.size, c.vocab_size % self.size);
        let start = self.rank * n + self.rank.min(extra);
        start..start + n + usize::from(self.rank < extra)
    }

    /// The configuration of this rank's part: its heads and intermediate width (the KV cache
    /// and the attention kernels are sized from it); `vocab_size` stays the whole
    /// vocabulary's.
    pub fn local_config(&self, c: &Qwen2Config) -> Qwen2Config {
        Qwen2Config {
            num_attention_heads: self.heads(c).len(),
            num_key_value_heads: self.kv_heads(c).len(),
            intermediate_size: self.intermediate(c).len(),
            ..c.clone()
        }
    }
}

/// The collective the ranks' partial products are summed with: an in-place sum over the
/// group, equal bytes on every rank afterwards, in the order every rank calls it.
pub trait AllReduce: Send + Sync + Debug {
    /// The element-wise sum of `x [M, N]` over the ranks, returned on every rank.
    fn sum(&self, x: Tensor<2>) -> Tensor<2>;

    /// [`Self::sum`] for work outside the step graphs (the sampler's exchange, gathered logits):
    /// over a collective of its own where the transport keeps one, so that it does not share
    /// a communicator with the collectives recorded in the graphs. [`Self::sum`] by default.
    fn sum_outside_graphs(&self, x: Tensor<2>) -> Tensor<2> {
        self.sum(x)
    }

    /// The least of every rank's `value` (the ranks agree on sizes they measured apart,
    /// such as the KV pool's blocks).
    fn min(&self, value: usize) -> usize;

    /// With `fixed`, every sum adds the ranks' terms in one order whatever the message's size
    /// (batch-invariant inference); transports that always do need nothing.
    fn set_fixed_order(&self, fixed: bool) {
        let _ = fixed;
    }

    /// Ends the group for every rank because this one failed (`reason`): the others' pending
    /// and later sums fail instead of waiting for it forever.
    fn abort(&self, reason: &str);
}

/// A rank's collective inside its layers: its place in the group and the sum.
#[derive(Clone, Debug)]
pub struct Parallel {
    /// This rank.
    pub rank: TpRank,
    /// The group's sum.
    pub all_reduce: Arc<dyn AllReduce>,
    /// Split the embedding and the LM head by vocabulary rows ([`TpRank::vocab`]) instead of
    /// keeping them whole on every rank.
    pub vocab_parallel: bool,
}

impl Parallel {
    /// The whole logits `[rows, vocab_size]` from each rank's columns (`shard [rows, V_shard]`,
    /// tokens `first..`; same dtype on every rank): each rank's shard placed in zeros, summed
    /// over the group (exact: every column has one non-zero term). An all-gather through the
    /// sum; for the rows whose draw needs them whole (filters, log-probabilities).
    pub fn gather_vocab(&self, shard: Tensor<2>, first: usize, vocab_size: usize) -> Tensor<2> {
        let [rows, v] = shard.dims();
        let whole = Tensor::<2>::zeros([rows, vocab_size], (&shard.device(), shard.dtype()));
        let whole = whole.slice_assign([0..rows, first..first + v], shard);
        self.all_reduce.sum_outside_graphs(whole)
    }
}

/// Ranks as threads of one process, the collective a host sum in rank order (so every rank
/// gets the same bits): the CPU reference of tensor parallelism, for tests. A sum of an
/// aborted group panics with the reason (the engine counts a panicking forward as a failed
/// device).
#[derive(Debug)]
pub struct HostAllReduce {
    rank: usize,
    group: Arc<HostGroup>,
}

#[derive(Debug)]
struct HostGroup {
    size: usize,
    state: Mutex<HostState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct HostState {
    /// This round's parts, by rank.
    parts: Vec<Option<Part>>,
    arrived: usize,
    /// Completed rounds.
    round: u64,
    /// The last round's result.
    result: Option<Arc<Part>>,
    failed: Option<String>,
}

/// One rank's contribution to a round, and a round's result.
#[derive(Debug)]
enum Part {
    /// f32 values to sum.
    Values(Vec<f32>),
    /// A count to take the least of.
    Count(usize),
}

impl HostAllReduce {
    /// One collective per rank of a group of `size` threads.
    pub fn group(size: usize) -> Vec<Arc<dyn AllReduce>> {
        let group = Arc::new(HostGroup {
            size,
            state: Mutex::new(HostState {
                parts: (0..size).map(|_| None).collect(),
                ..HostState::default()
            }),
            changed: Condvar::new(),
        });
        (0..size)
            .map(|rank| {
                Arc::new(Self {
                    rank,
                    group: group.clone(),
                }) as Arc<dyn AllReduce>
            })
            .collect()
    }
}

impl HostAllReduce {
    /// One round: every rank's `part` combined in rank order, the result handed to all.
    fn round(&self, part: Part) -> Arc<Part> {
        let g = &self.group;
        let mut state = g.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(reason) = &state.failed {
            panic!("tensor-parallel group ended: {reason}");
        }
        state.parts[self.rank] = Some(part);
        state.arrived += 1;
        if state.arrived == g.size {
            let parts: Vec<Part> = state
                .parts
                .iter_mut()
                .map(|p| p.take().expect("every rank left its part"))
                .collect();
            let result = match &parts[0] {
                Part::Values(first) => {
                    let mut sum = vec![0.0f32; first.len()];
                    for part in &parts {
                        let Part::Values(v) = part else {
                            panic!("the ranks called different collectives");
                        };
                        sum.iter_mut().zip(v).for_each(|(s, x)| *s += x);
                    }
                    Part::Values(sum)
                }
                Part::Count(_) => Part::Count(
                    parts
                        .iter()
                        .map(|p| match p {
                            Part::Count(c) => *c,
                            Part::Values(_) => panic!("the ranks called different collectives"),
                        })
                        .min()
                        .unwrap_or(0),
                ),
            };
            state.result = Some(Arc::new(result));
            state.arrived = 0;
            state.round += 1;
            g.changed.notify_all();
        } else {
            let round = state.round;
            while state.round == round && state.failed.is_none() {
                state = g.changed.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            if state.round == round {
                let reason = state.failed.clone().unwrap_or_default();
                panic!("tensor-parallel group ended: {reason}");
            }
        }
        state.result.clone().expect("the round's result")
    }
}

impl AllReduce for HostAllReduce {
    fn sum(&self, x: Tensor<2>) -> Tensor<2> {
        let (device, dtype, shape) = (x.device(), x.dtype(), x.shape());
        let values = x
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32 values");
        let Part::Values(sum) = &*self.round(Part::Values(values)) else {
            unreachable!("a sum round")
        };
        Tensor::from_data(TensorData::new(sum.clone(), shape), (&device, dtype))
    }

    fn min(&self, value: usize) -> usize {
        match *self.round(Part::Count(value)) {
            Part::Count(c) => c,
            Part::Values(_) => unreachable!("a count round"),
        }
    }

    fn abort(&self, reason: &str) {
        let mut state = self.group.state.lock().unwrap_or_else(|e| e.into_inner());
        state
            .failed
            .get_or_insert_with(|| format!("rank {}: {reason}", self.rank));
        self.group.changed.notify_all();
    }
}

/// The collective of one process per GPU: NCCL on CubeCL's stream
/// ([`cubecl_kernels::all_reduce`]). A failed collective panics with NCCL's error (the engine
/// counts a panicking forward as a failed device).
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct NcclAllReduce {
    /// The communicator.
    pub comm: Arc<cubecl_kernels::NcclComm>,
    /// A second communicator of the same ranks for [`AllReduce::sum_outside_graphs`], if any
    /// (NCCL serialises a communicator's eager operations with those its graphs hold).
    pub outside_graphs: Option<Arc<cubecl_kernels::NcclComm>>,
    /// This rank's device.
    pub device: burn::tensor::Device,
}

#[cfg(feature = "cuda")]
impl AllReduce for NcclAllReduce {
    fn sum(&self, x: Tensor<2>) -> Tensor<2> {
        cubecl_kernels::all_reduce_sum(x, &self.comm).unwrap_or_else(|e| panic!("{e}"))
    }

    fn sum_outside_graphs(&self, x: Tensor<2>) -> Tensor<2> {
        let comm = self.outside_graphs.as_ref().unwrap_or(&self.comm);
        cubecl_kernels::all_reduce_sum(x, comm).unwrap_or_else(|e| panic!("{e}"))
    }

    fn min(&self, value: usize) -> usize {
        let x = Tensor::<2>::from_data(
            TensorData::new(vec![value as f32], [1, 1]),
            (&self.device, burn::tensor::DType::F32),
        );
        let least = cubecl_kernels::all_reduce(x, &self.comm, cubecl_kernels::Reduction::Min)
            .unwrap_or_else(|e| panic!("{e}"));
        least
            .into_data()
            .convert::<f32>()
            .as_slice::<f32>()
            .expect("f32")[0] as usize
    }

    fn set_fixed_order(&self, fixed: bool) {
        self.comm.set_fixed_order(fixed);
        if let Some(comm) = &self.outside_graphs {
            comm.set_fixed_order(fixed);
        }
    }

    fn abort(&self, reason: &str) {
        self.comm.abort(reason);
        if let Some(comm) = &self.outside_graphs {
            comm.abort(reason);
        }
    }
}
