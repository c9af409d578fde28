//! Decode steps replayed as CUDA graphs, one per batch-size bucket.
//!
//! Each bucket owns stable input buffers (token ids, positions, slots, context lengths and the
//! block tables as one flat `[bucket · width]` buffer, `width = ceil(max_model_len /
//! block_size)`) and a graph captured over a whole decode forward that reads them; a step
//! writes its rows into the smallest bucket that holds them (padding rows: token 0, position 0,
//! no KV write, a one-key context in block 0), replays it and reads the logits of its rows. The
//! decode kernel's context split is captured for `max_model_len` (`with_context_bound`), so a
//! graph captured at short contexts stays valid as they grow.

use std::sync::{Arc, Mutex};

use burn::tensor::{DType, Device, Graph, Int, Tensor, TensorData, capture};
use cubecl_kernels::{AttentionMetadata, DecodeTensors, MetadataTensors, write_ints};
use model_qwen2::{KvCache, LogitsRows, Qwen2Model};

use crate::error::{EngineError, Result};
use crate::model_runner::StepSeq;

type Forward = Box<dyn FnMut() -> Tensor<2> + Send>;

struct DecodeGraph {
    batch: usize,
    input_ids: Tensor<1, Int>,
    positions: Tensor<1, Int>,
    slots: Tensor<1, Int>,
    context_lens: Tensor<1, Int>,
    tables: Tensor<1, Int>,
    graph: Graph<Tensor<2>, Forward>,
}

/// The captured decode graphs of a model, by batch size.
pub(crate) struct DecodeGraphs {
    graphs: Vec<DecodeGraph>,
    width: usize,
    block_size: usize,
}

/// Batch sizes to capture up to `max_num_seqs`: 1, 2, 4, 8, 16, then steps of 16 to 64 and
/// of 32 beyond (a padded row costs a whole row of the step; finer buckets cost memory).
pub(crate) fn bucket_sizes(max_num_seqs: usize) -> Vec<usize> {
    let mut sizes = vec![1, 2, 4, 8, 16];
    let mut b = 16;
    while b < max_num_seqs {
        b += if b < 64 { 16 } else { 32 };
        sizes.push(b);
    }
    sizes.retain(|&s| s < max_num_seqs);
    sizes.push(max_num_seqs);
    sizes
}

fn ints(values: Vec<i32>, device: &Device) -> Tensor<1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, DType::I32))
}

impl DecodeGraphs {
    /// Captures one graph per size in `sizes`. Returns `None` when the device has no hardware
    /// graphs (the engine then runs decode steps eagerly).
    pub(crate) fn capture(
        model: &Arc<Qwen2Model>,
        cache: &Arc<Mutex<KvCache>>,
        device: &Device,
        sizes: &[usize],
        block_size: usize,
        max_model_len: usize,
    ) -> Result<Option<Self>> {
        let width = max_model_len.div_ceil(block_size);
        let mut graphs = Vec::with_capacity(sizes.len());
        for &b in sizes {
            let input_ids = ints(vec![0; b], device);
            let positions = ints(vec![0; b], device);
            let slots = ints(vec![-1; b], device);
            let context_lens = ints(vec![1; b], device);
            let tables = ints(vec![0; b * width], device);
            let meta = AttentionMetadata::from_parts(
                vec![1; b],
                vec![1; b],
                vec![vec![0]; b],
                block_size,
                vec![-1; b],
                // The host positions only bound the RoPE-table check: cover every future one.
                vec![max_model_len as i64 - 1; b],
                MetadataTensors {
                    slot_mapping: slots.clone(),
                    positions: positions.clone(),
                    decode: Some(DecodeTensors {
                        block_tables: tables.clone().reshape([b, width]),
                        context_lens: context_lens.clone(),
                    }),
                    prefill: None,
                },
            )
            .with_context_bound(max_model_len);
            let (model, cache, ids) = (model.clone(), cache.clone(), input_ids.clone());
            let forward: Forward = Box::new(move || {
                let mut cache = cache.lock().expect("KV cache lock");
                model.forward(ids.clone(), &meta, &mut cache, LogitsRows::All)
            });
            let graph = capture(device, forward);
            if !graph.is_hardware() {
                return Ok(None);
            }
            graphs.push(DecodeGraph {
                batch: b,
                input_ids,
                positions,
                slots,
                context_lens,
                tables,
                graph,
            });
        }
        Ok(Some(Self {
            graphs,
            width,
            block_size,
        }))
    }

    /// The captured sizes.
    pub(crate) fn sizes(&self) -> Vec<usize> {
        self.graphs.iter().map(|g| g.batch).collect()
    }

    /// Runs a decode step of `seqs` (one new token each) through the smallest graph that holds
    /// it; returns the logits `[seqs.len(), V]` (f32), or `None` when no graph is large enough.
    pub(crate) fn run(&mut self, seqs: &[StepSeq<'_>]) -> Result<Option<Tensor<2>>> {
        let n = seqs.len();
        let Some(g) = self.graphs.iter_mut().find(|g| g.batch >= n) else {
            return Ok(None);
        };
        let (b, width, bs) = (g.batch, self.width, self.block_size);
        let mut ids = vec![0i32; b];
        let mut positions = vec![0i32; b];
        let mut slots = vec![-1i32; b];
        let mut context = vec![1i32; b];
        let mut tables = vec![0i32; b * width];
        for (r, s) in seqs.iter().enumerate() {
            let pos = s.num_computed_tokens;
            if s.block_table.len() > width {
                return Err(EngineError::Device(format!(
                    "a sequence holds {} blocks, more than the graphs' {width}",
                    s.block_table.len()
                )));
            }
            ids[r] = s.token_ids[pos] as i32;
            positions[r] = pos as i32;
            slots[r] = (s.block_table[pos / bs] as usize * bs + pos % bs) as i32;
            context[r] = (pos + 1) as i32;
            for (j, &blk) in s.block_table.iter().enumerate() {
                tables[r * width + j] = blk as i32;
            }
        }
        write_ints(&mut g.input_ids, &ids)?;
        write_ints(&mut g.positions, &positions)?;
        write_ints(&mut g.slots, &slots)?;
        write_ints(&mut g.context_lens, &context)?;
        write_ints(&mut g.tables, &tables)?;
        // SAFETY: the graph reads the buffers above (kept alive here), the model's weights and
        // the KV cache (kept alive by the closure it owns), and writes its own pinned
        // intermediates; everything runs on the one device stream, and the logits are read
        // (by the sampler) before the next replay.
        let logits = unsafe { g.graph.replay() }.clone();
        Ok(Some(if n == b {
            logits
        } else {
            logits.slice_dim(0, 0..n)
        }))
    }
}
