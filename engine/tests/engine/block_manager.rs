//! The block pool and the prefix cache.

use std::sync::Arc;

use engine::{BlockManager, SamplingParams, Sequence};

fn seq(id: u64, tokens: Vec<u32>) -> Sequence {
    Sequence::new(id, tokens, Arc::new(SamplingParams::default()), 0)
}

/// Computes a sequence's whole prompt (as the engine would) and registers its full blocks.
fn compute_all(bm: &mut BlockManager, s: &mut Sequence) {
    let hit = bm.find_prefix(&s.token_ids);
    let cached = hit.blocks.len() * bm.block_size();
    let chunk = s.num_tokens() - cached;
    assert!(bm.blocks_to_admit(&hit, chunk) <= bm.num_free_blocks());
    bm.admit(s, hit, chunk);
    s.num_computed_tokens += chunk;
    bm.cache_full_blocks(s);
}

#[test]
fn shared_prefix_reuses_blocks_and_keeps_the_last_token_to_compute() {
    let mut bm = BlockManager::new(32, 4, true);
    let prefix: Vec<u32> = (0..10).collect();
    let mut a = seq(0, prefix.clone());
    compute_all(&mut bm, &mut a);
    assert_eq!(a.num_cached_tokens, 0);
    assert_eq!(a.block_table.len(), 3);
    // Same first 8 tokens (two full blocks), different tail.
    let mut b_tokens = prefix[..8].to_vec();
    b_tokens.extend([100, 101, 102]);
    let mut b = seq(1, b_tokens);
    compute_all(&mut bm, &mut b);
    assert_eq!(b.num_cached_tokens, 8);
    assert_eq!(&b.block_table[..2], &a.block_table[..2]);
    assert_ne!(b.block_table[2], a.block_table[2]);
    assert_eq!(bm.ref_count(a.block_table[0]), 2);
    // A full-prompt hit (12 tokens = 3 full blocks, all cached) still computes its last block.
    let mut c = seq(2, (0..12).collect());
    compute_all(&mut bm, &mut c);
    let mut d = seq(3, (0..12).collect());
    let hit = bm.find_prefix(&d.token_ids);
    assert_eq!(
        hit.blocks.len(),
        2,
        "the last block is recomputed, not shared"
    );
    compute_all(&mut bm, &mut d);
    assert_eq!(d.num_cached_tokens, 8);
    assert_ne!(d.block_table[2], c.block_table[2]);
    bm.check_invariants([
        a.block_table.as_slice(),
        &b.block_table,
        &c.block_table,
        &d.block_table,
    ])
    .unwrap();
}

#[test]
fn freed_blocks_stay_cached_until_evicted_least_recent_first() {
    let mut bm = BlockManager::new(4, 4, true);
    let mut a = seq(0, (0..9).collect()); // 2 full blocks + 1 partial
    compute_all(&mut bm, &mut a);
    bm.free(&mut a);
    assert_eq!(bm.num_free_blocks(), 4);
    // The same prefix comes back: both full blocks hit, though they were free.
    let mut b = seq(1, (0..9).collect());
    assert_eq!(bm.find_prefix(&b.token_ids).blocks.len(), 2);
    compute_all(&mut bm, &mut b);
    assert_eq!(b.num_cached_tokens, 8);
    bm.free(&mut b);
    // A different prompt needing all 4 blocks evicts the cached ones.
    let mut c = seq(2, (50..66).collect());
    compute_all(&mut bm, &mut c);
    assert_eq!(
        bm.find_prefix(&(0..9).collect::<Vec<u32>>()).blocks.len(),
        0
    );
    bm.check_invariants([c.block_table.as_slice()]).unwrap();
}

#[test]
fn different_tokens_never_match() {
    // A prefix matches block by block; a different block (or order) ends the match.
    let mut bm = BlockManager::new(8, 2, true);
    let mut a = seq(0, vec![1, 2, 3]);
    compute_all(&mut bm, &mut a);
    assert_eq!(bm.find_prefix(&[1, 2, 9]).blocks.len(), 1);
    assert_eq!(bm.find_prefix(&[2, 1, 9]).blocks.len(), 0);
    assert_ne!(
        BlockManager::hash_block(None, &[1, 2]),
        BlockManager::hash_block(Some(0), &[1, 2])
    );
}

#[test]
#[should_panic(expected = "double free")]
fn double_free_is_refused() {
    let mut bm = BlockManager::new(4, 4, true);
    let mut a = seq(0, vec![1, 2, 3]);
    compute_all(&mut bm, &mut a);
    let table = a.block_table.clone();
    bm.free(&mut a);
    a.block_table = table;
    bm.free(&mut a);
}

#[test]
fn prefix_caching_off_never_hits() {
    let mut bm = BlockManager::new(8, 2, false);
    let mut a = seq(0, vec![1, 2, 3, 4, 5]);
    compute_all(&mut bm, &mut a);
    assert!(bm.find_prefix(&[1, 2, 3, 4, 5]).blocks.is_empty());
}
