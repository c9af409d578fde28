//! Property tests of the scheduler and block manager: random arrivals, lengths, shared
//! prefixes, aborts and finishes, with the KV cache simulated slot by slot.

use std::collections::HashMap;
use std::sync::Arc;

use engine::scheduler::{Admission, STALL_STEPS, Scheduler, SchedulerLimits, SchedulerOutput};
use engine::{BlockManager, FinishReason, SamplingParams, Sequence};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Request {
    arrival: usize,
    prefix: usize,
    prompt_len: usize,
    max_tokens: usize,
    abort_after: Option<usize>,
}

fn request() -> impl Strategy<Value = Request> {
    (
        0usize..30,
        0usize..3,
        1usize..70,
        1usize..40,
        prop::option::weighted(0.15, 0usize..20),
    )
        .prop_map(
            |(arrival, prefix, prompt_len, max_tokens, abort_after)| Request {
                arrival,
                prefix,
                prompt_len,
                max_tokens,
                abort_after,
            },
        )
}

/// Prompts share one of three token streams, so that prefix hits happen.
fn prompt(r: &Request) -> Vec<u32> {
    (0..r.prompt_len as u32)
        .map(|i| (r.prefix as u32) * 1000 + i)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn scheduling_never_leaks_shares_written_blocks_or_exceeds_the_budget(
        requests in prop::collection::vec(request(), 1..24),
        num_blocks in 6usize..48,
        block_size in prop::sample::select(vec![1usize, 2, 4, 16]),
        max_num_seqs in 1usize..8,
        extra_budget in 0usize..48,
        prefix_caching in any::<bool>(),
        token_seed in any::<u32>(),
        step_sizes in prop::collection::vec(1usize..64, 0..4),
        max_prefill_chunks in 1usize..4,
        min_tokens in prop::sample::select(vec![0usize, 8, 40, 1000]),
        max_wait_steps in 0usize..6,
    ) {
        let max_num_batched_tokens = max_num_seqs + extra_budget;
        // With step sizes (graph buckets), at most `max_prefill_chunks` prefill chunks a step.
        let chunk_cap = if step_sizes.is_empty() { usize::MAX } else { max_prefill_chunks };
        let mut s = Scheduler::new(
            SchedulerLimits { max_num_seqs, max_num_batched_tokens },
            BlockManager::new(num_blocks, block_size, prefix_caching),
        )
        .with_step_sizes(step_sizes.clone(), chunk_cap)
        .with_admission(Admission { min_tokens, max_wait_steps });
        let capacity = num_blocks * block_size;
        // What each slot holds: (token, position), written when a step computes it.
        let mut kv: Vec<Option<(u32, usize)>> = vec![None; capacity];
        let mut live: HashMap<u64, (Request, usize)> = HashMap::new();
        let mut ended = 0usize;
        let mut admitted = 0usize;
        let mut step = 0usize;
        while ended < admitted || step <= 30 {
            prop_assert!(step < 20_000, "did not finish");
            for (i, r) in requests.iter().enumerate() {
                // The engine refuses prompts the pool cannot hold.
                if r.arrival == step && r.prompt_len < capacity {
                    let params = SamplingParams { max_tokens: r.max_tokens, ..SamplingParams::default() };
                    s.add(Sequence::new(i as u64, prompt(r), Arc::new(params), 0));
                    live.insert(i as u64, (r.clone(), step));
                    admitted += 1;
                }
            }
            let out = s.schedule();
            prop_assert!(out.num_tokens() <= max_num_batched_tokens);
            prop_assert!(out.seqs.len() <= max_num_seqs);
            prop_assert!(out.seqs[..out.num_decodes].iter().all(|q| q.num_new_tokens == 1));
            prop_assert!(out.seqs[out.num_decodes..].iter().all(|q| q.num_new_tokens > 1));
            prop_assert!(out.seqs.len() - out.num_decodes <= chunk_cap);
            let bm = s.block_manager();
            if let Err(e) = bm.check_invariants(s.block_tables()) {
                prop_assert!(false, "{}", e);
            }
            for q in &out.seqs {
                let seq = s.get(q.id).unwrap();
                // The cached context holds this sequence's tokens (prefix hits included).
                for p in 0..seq.num_computed_tokens {
                    let slot = seq.block_table[p / block_size] as usize * block_size + p % block_size;
                    prop_assert_eq!(kv[slot], Some((seq.token_ids[p], p)), "slot {} of seq {}", slot, q.id);
                }
                // Blocks it writes are its alone.
                let first = seq.num_computed_tokens / block_size;
                let last = (seq.num_computed_tokens + q.num_new_tokens - 1) / block_size;
                for &b in &seq.block_table[first..=last] {
                    prop_assert_eq!(bm.ref_count(b), 1, "block {} written while shared", b);
                }
            }
            for q in &out.seqs {
                let seq = s.get(q.id).unwrap();
                for p in seq.num_computed_tokens..seq.num_computed_tokens + q.num_new_tokens {
                    let slot = seq.block_table[p / block_size] as usize * block_size + p % block_size;
                    kv[slot] = Some((seq.token_ids[p], p));
                }
            }
            for q in &out.seqs {
                s.on_computed(q);
            }
            for q in out.seqs.iter().filter(|q| q.samples) {
                let seq = s.get_mut(q.id).unwrap();
                let t = token_seed.wrapping_mul(31).wrapping_add(seq.num_tokens() as u32 * 7 + q.id as u32) % 50;
                seq.token_ids.push(t);
                if seq.num_output_tokens() >= seq.params.max_tokens {
                    s.finish(q.id, FinishReason::Length);
                }
            }
            for (&id, (r, arrived)) in &live {
                if r.abort_after.is_some_and(|a| arrived + a == step) {
                    s.finish(id, FinishReason::Abort);
                }
            }
            for id in out.failed.iter() {
                let seq = s.get(*id).unwrap();
                prop_assert!(matches!(seq.finish_reason, Some(FinishReason::Error(_))));
                // Only a sequence that cannot fit alone may fail.
                prop_assert!(seq.num_tokens() > capacity, "failed at {} tokens", seq.num_tokens());
            }
            let finished: Vec<u64> = live.keys().copied().filter(|id| s.get(*id).is_some_and(|q| q.is_finished())).collect();
            for id in finished {
                let seq = s.take_finished(id).unwrap();
                prop_assert!(seq.block_table.is_empty());
                if seq.finish_reason == Some(FinishReason::Length) {
                    prop_assert_eq!(seq.num_output_tokens(), seq.params.max_tokens);
                }
                live.remove(&id);
                ended += 1;
            }
            step += 1;
        }
        prop_assert!(!s.has_unfinished());
        prop_assert_eq!(s.block_manager().num_free_blocks(), num_blocks);
        if let Err(e) = s.block_manager().check_invariants(std::iter::empty()) {
            prop_assert!(false, "{}", e);
        }
    }
}

/// Runs `out` as the engine would: computes it and appends token 7 to every sampling row.
fn compute(s: &mut Scheduler, out: &SchedulerOutput) {
    for q in &out.seqs {
        s.on_computed(q);
        if q.samples {
            s.get_mut(q.id).unwrap().token_ids.push(7);
        }
    }
}

/// Prompt lengths of the rows a step admits (rows that start a prompt).
fn admitted(s: &Scheduler, out: &SchedulerOutput) -> Vec<usize> {
    out.seqs[out.num_decodes..]
        .iter()
        .filter(|q| s.get(q.id).unwrap().num_computed_tokens == 0)
        .map(|q| q.num_new_tokens)
        .collect()
}

#[test]
fn a_busy_batch_admits_prompts_once_they_fill_the_token_threshold_or_waited_long_enough() {
    let params = Arc::new(SamplingParams {
        max_tokens: 100,
        ..SamplingParams::default()
    });
    let mut s = Scheduler::new(
        SchedulerLimits {
            max_num_seqs: 12,
            max_num_batched_tokens: 256,
        },
        BlockManager::new(256, 4, false),
    )
    .with_admission(Admission {
        min_tokens: 40,
        max_wait_steps: 5,
    });
    let step = |s: &mut Scheduler, finish: &[u64]| {
        for &id in finish {
            s.finish(id, FinishReason::Length);
        }
        let out = s.schedule();
        let got = admitted(s, &out);
        compute(s, &out);
        got
    };
    let none = Vec::<usize>::new();
    // An idle batch admits at once.
    for id in 0..12 {
        s.add(Sequence::new(id, vec![1, 2], params.clone(), 0));
    }
    assert_eq!(step(&mut s, &[]), vec![2; 12]);
    for id in 20..26 {
        s.add(Sequence::new(id, vec![3; 4], params.clone(), 0));
    }
    for id in 30..34 {
        s.add(Sequence::new(id, vec![4; 30], params.clone(), 0));
    }
    // A place frees every step; the free places' prompts (4 … 20 tokens) stay under 40 and
    // wait, until the wait limit (5 steps) admits the six at 24 tokens.
    for id in 0..5 {
        assert_eq!(step(&mut s, &[id]), none);
    }
    assert_eq!(step(&mut s, &[5]), vec![4; 6]);
    // 30 tokens wait; 60 pass the threshold.
    assert_eq!(step(&mut s, &[6]), none);
    assert_eq!(step(&mut s, &[7]), vec![30, 30]);
    // Places stop freeing: after `STALL_STEPS` steps without one, what waits is admitted
    // (before the wait limit).
    assert_eq!(step(&mut s, &[8]), none);
    for _ in 1..STALL_STEPS {
        assert_eq!(step(&mut s, &[]), none);
    }
    const { assert!(STALL_STEPS < 5) };
    assert_eq!(step(&mut s, &[]), vec![30]);
    // Fewer waiting prompts than free places: at once.
    assert_eq!(step(&mut s, &[9]), vec![30]);
    assert_eq!(s.num_waiting(), 0);
}
