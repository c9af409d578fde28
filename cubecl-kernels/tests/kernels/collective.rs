//! Which of tensor parallelism's IPC all-reduce kernels a message takes (the kernels themselves
//! run on the GPU machine: `benches all-reduce`).

use cubecl_kernels::AllReduceKernel as K;

#[test]
fn messages_take_the_kernel_their_size_and_the_group_call_for() {
    let push = |ranks, bytes| K::choose(ranks, bytes, false);
    // A decode step's sums: [rows, hidden] bf16.
    assert_eq!(push(4, 64 * 3584 * 2), Some(K::PushOne));
    assert_eq!(push(4, 256 * 8192 * 2), Some(K::PushTwo));
    assert_eq!(push(2, 256 * 8192 * 2), Some(K::PushOne));
    assert_eq!(K::choose(4, 256 * 8192 * 2, true), Some(K::PullTwo));
    assert_eq!(K::choose(4, 4096, true), Some(K::PullOne));
    // Beyond the buffers, not whole 16-byte vectors, or empty: NCCL's.
    assert_eq!(push(4, K::CAPACITY + 16), None);
    assert_eq!(push(4, 7 * 2), None);
    assert_eq!(push(4, 0), None);
    // Above the one-shot size but not splittable into 4 whole-vector parts: one-shot while
    // 4 copies fit its region, else NCCL.
    assert_eq!(push(4, K::ONE_SHOT_MAX + 16), Some(K::PushOne));
    assert_eq!(push(4, 2 * K::CAPACITY / 4 + 16), None);
    assert_eq!(push(4, K::CAPACITY), Some(K::PushTwo));
}
