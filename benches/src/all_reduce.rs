//! Tensor parallelism's sum on its own: `benches all-reduce --tensor-parallel-size N` starts one
//! process per GPU (this binary again, rank in `BENCHES_ALL_REDUCE_RANK`), joins an NCCL group
//! and, for each message (dtype × rows × width), checks 8 back-to-back sums of known values on
//! every rank against the exact sums, then times back-to-back sums on the device's stream. Run it with
//! `BURN_NANOVLLM_ALL_REDUCE=nccl` for NCCL at every size, without for the group's IPC kernels
//! where they apply.

use std::process::{Child, Command};

use anyhow::{Context, Result, bail};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use cubecl_kernels::{NcclComm, NcclId, all_reduce_sum, mark_stream};

use serde_json::Value;

use crate::report::Report;

const RANK_ENV: &str = "BENCHES_ALL_REDUCE_RANK";
const ID_ENV: &str = "BENCHES_ALL_REDUCE_ID";
const SIZE_ENV: &str = "BENCHES_ALL_REDUCE_SIZE";

/// Widths of the sums (the hidden sizes of Qwen2.5-7B, 32B and 72B) and rows.
const WIDTHS: [usize; 3] = [3584, 5120, 8192];
const ROWS: [usize; 6] = [1, 16, 64, 256, 512, 1024];
/// Messages of each shape checked, summed back to back.
const BACK_TO_BACK: usize = 8;
/// Timed calls per message.
const ITERS: usize = 200;
/// Side of the square products that keep the device busy while the timed calls are queued.
const BUSY: usize = 8192;

/// Rank `r`'s value at flat index `i`: multiples of 1/4 in [-2, 2], so the sum over up to 8
/// ranks is exact in bf16, f16 and f32.
fn value(i: usize, rank: usize) -> f32 {
    ((i * 7 + rank * 13) % 17) as f32 * 0.25 - 2.0
}

/// Rank 0: starts ranks 1.. as processes, runs its own part, and returns the table.
pub fn run(size: usize, dtypes: &[DType]) -> Result<Report> {
    if size < 2 {
        bail!("the all-reduce suite needs --tensor-parallel-size 2 or more");
    }
    let id = NcclId::new()?;
    let exe = std::env::current_exe()?;
    let mut children: Vec<Child> = Vec::new();
    for rank in 1..size {
        // Placed as the engine places its workers.
        let gpu = engine::tensor_parallel::processes::worker_gpu(0, rank)?;
        children.push(
            Command::new(&exe)
                .args(std::env::args().skip(1))
                .env(RANK_ENV, rank.to_string())
                .env(SIZE_ENV, size.to_string())
                .env(ID_ENV, id.to_hex())
                .env("CUDA_VISIBLE_DEVICES", gpu)
                .spawn()
                .with_context(|| format!("all-reduce rank {rank}"))?,
        );
    }
    let table = rank_main(id, 0, size, dtypes);
    for (i, mut child) in children.into_iter().enumerate() {
        let status = child.wait()?;
        if !status.success() {
            bail!("all-reduce rank {} failed: {status}", i + 1);
        }
    }
    table
}

/// In a rank's process: serves it and exits (rank 0 and other processes return).
pub fn serve_if_worker(dtypes: &[DType]) {
    let Ok(rank) = std::env::var(RANK_ENV) else {
        return;
    };
    let result = (|| -> Result<()> {
        let rank: usize = rank.parse()?;
        let size: usize = std::env::var(SIZE_ENV)?.parse()?;
        let id = NcclId::from_hex(&std::env::var(ID_ENV)?)?;
        rank_main(id, rank, size, dtypes).map(|_| ())
    })();
    if let Err(e) = result {
        eprintln!("all-reduce rank {rank}: {e:#}");
        std::process::exit(1);
    }
    std::process::exit(0);
}

fn rank_main(id: NcclId, rank: usize, size: usize, dtypes: &[DType]) -> Result<Report> {
    let device = cubecl_kernels::DeviceKind::Cuda(0).device()?;
    let comm = NcclComm::join(id, rank, size, 0)?;
    let path = if comm.has_peer_all_reduce() {
        "ipc kernels + nccl"
    } else {
        "nccl"
    };
    let mut table = Report::new(
        &format!("all-reduce ({path}), {size} ranks, device time per call, back to back"),
        &["dtype", "rows", "width", "MB", "exact", "us per call"],
    );
    // Sizes the kernels must refuse (not a multiple of 16 bytes) go to NCCL: checked too.
    let mut shapes: Vec<(usize, usize)> = vec![(1, 7), (3, 1000)];
    for width in WIDTHS {
        for rows in ROWS {
            shapes.push((rows, width));
        }
    }
    for &dtype in dtypes {
        for &(rows, width) in &shapes {
            let n = rows * width;
            // Distinct messages summed back to back (no read between them): the kernels'
            // buffers and barriers are reused call after call, as in a step.
            let inputs: Vec<Tensor<2>> = (0..BACK_TO_BACK)
                .map(|j| {
                    let data: Vec<f32> = (0..n).map(|i| value(i + j, rank)).collect();
                    Tensor::<2>::from_data(TensorData::new(data, [rows, width]), (&device, dtype))
                })
                .collect();
            let sums = inputs
                .into_iter()
                .map(|x| all_reduce_sum(x, &comm))
                .collect::<Result<Vec<_>, _>>()?;
            let mut wrong = 0;
            for (j, sum) in sums.into_iter().enumerate() {
                let got = sum.into_data().convert::<f32>();
                let got = got.as_slice::<f32>().expect("f32");
                wrong += (0..n)
                    .filter(|&i| got[i] != (0..size).map(|r| value(i + j, r)).sum::<f32>())
                    .count();
            }
            let checked = n * BACK_TO_BACK;
            let us = time(&device, &comm, rows, width, dtype)?;
            table.row(vec![
                Value::from(format!("{dtype:?}")),
                Value::from(rows),
                Value::from(width),
                Value::from((n * dtype.size()) as f64 / 1e6),
                Value::from(match wrong {
                    0 => "yes".to_string(),
                    w => format!("NO ({w} of {checked} wrong)"),
                }),
                us.map_or(Value::Null, Value::from),
            ]);
            if wrong != 0 {
                eprintln!(
                    "rank {rank}: {dtype:?} [{rows}, {width}]: {wrong} of {checked} sums wrong"
                );
            }
        }
    }
    Ok(table)
}

/// Device microseconds per sum of zeros `[rows, width]` over `ITERS` back-to-back calls.
fn time(
    device: &Device,
    comm: &std::sync::Arc<NcclComm>,
    rows: usize,
    width: usize,
    dtype: DType,
) -> Result<Option<f64>> {
    let anchor = Tensor::<1, Int>::zeros([1], device);
    let mut x = Tensor::<2>::zeros([rows, width], (device, dtype));
    for _ in 0..10 {
        x = all_reduce_sum(x, comm)?;
    }
    // ~20 ms of products first, so that the sums' launches (tens of µs of host work each) are
    // all queued before the device reaches them: the marks then time the device alone.
    let a = Tensor::<2>::ones([BUSY, BUSY], (device, dtype));
    let mut busy = a.clone();
    for _ in 0..16 {
        busy = a.clone().matmul(busy);
    }
    let Some(start) = mark_stream(&anchor)? else {
        return Ok(None);
    };
    for _ in 0..ITERS {
        x = all_reduce_sum(x, comm)?;
    }
    let end = mark_stream(&anchor)?.context("gpu mark")?;
    drop((x, busy));
    Ok(Some(end.ms_since(&start)? as f64 * 1e3 / ITERS as f64))
}
