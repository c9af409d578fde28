//! Tensor parallelism of a Qwen2/Qwen3 layer (Megatron's split, as nano-vLLM and vLLM do it):
//! q/k/v and gate/up split by output columns (each merged part separately, biases too),
//! o_proj and down by input columns, each followed by one all-reduce of the partial products
//! (the residual added once, by rank 0). Query heads split evenly; key/value heads split when
//! they divide by the size, else replicated (each rank keeps the head its query heads read, as
//! vLLM does: Qwen2-0.5B has 2 KV heads). The embedding, final norm and LM head are whole on
//! every rank, so every rank computes the same logits and draws the same tokens.

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

    /// The configuration of this rank's part: its heads and intermediate width (the KV cache
    /// and the attention kernels are sized from it).
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
    parts: Vec<Option<TensorData>>,
    arrived: usize,
    /// Completed rounds.
    round: u64,
    /// The last round's sum.
    sum: Option<Arc<Vec<f32>>>,
    failed: Option<String>,
}

impl HostAllReduce {
    /// One collective per rank of a group of `size` threads.
    pub fn group(size: usize) -> Vec<Arc<dyn AllReduce>> {
        let group = Arc::new(HostGroup {
            size,
            state: Mutex::new(HostState {
                parts: vec![None; size],
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

impl AllReduce for HostAllReduce {
    fn sum(&self, x: Tensor<2>) -> Tensor<2> {
        let (device, dtype, shape) = (x.device(), x.dtype(), x.shape());
        let part = x.into_data().convert::<f32>();
        let g = &self.group;
        let mut state = g.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(reason) = &state.failed {
            panic!("tensor-parallel group ended: {reason}");
        }
        state.parts[self.rank] = Some(part);
        state.arrived += 1;
        if state.arrived == g.size {
            let mut sum = vec![0.0f32; shape.num_elements()];
            for part in state.parts.iter_mut() {
                let part = part.take().expect("every rank left its part");
                for (s, v) in sum
                    .iter_mut()
                    .zip(part.as_slice::<f32>().expect("f32 values"))
                {
                    *s += v;
                }
            }
            state.sum = Some(Arc::new(sum));
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
        let sum = state.sum.clone().expect("the round's sum");
        drop(state);
        Tensor::from_data(TensorData::new(sum.to_vec(), shape), (&device, dtype))
    }

    fn abort(&self, reason: &str) {
        let mut state = self.group.state.lock().unwrap_or_else(|e| e.into_inner());
        state
            .failed
            .get_or_insert_with(|| format!("rank {}: {reason}", self.rank));
        self.group.changed.notify_all();
    }
}
