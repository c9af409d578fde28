//! The KV block pool: reference-counted blocks, and the prefix cache that lets a sequence reuse
//! the blocks of an earlier one that began with the same tokens.
//!
//! A full block is identified by a chained hash: `h_i = xxh3(h_{i−1} ‖ tokens of block i)`, so
//! equal hashes mean equal prefixes (and the token ids are compared on a hit anyway). When a
//! sequence's block fills with computed tokens it is registered under its hash. Freed blocks
//! (reference count 0) keep their hash and contents on the free list, least recently freed
//! first; a later sequence with the same prefix takes them back, and allocation evicts them in
//! that order. A block being written is only ever held by the sequence writing it: cached
//! blocks are full, and a sequence computes only past its cached prefix.

use std::collections::HashMap;

use xxhash_rust::xxh3::Xxh3;

use crate::sequence::Sequence;

const NONE: u32 = u32::MAX;

/// One physical KV block.
#[derive(Clone, Debug, Default)]
struct Block {
    /// Sequences holding it.
    ref_count: u32,
    /// Its chained hash while it is registered in the prefix cache.
    hash: Option<u64>,
    /// The tokens it holds, while registered (a hit compares them).
    token_ids: Vec<u32>,
}

/// Free blocks in least-recently-freed order: an intrusive doubly linked list over block ids,
/// so a cached free block can leave from the middle in O(1).
#[derive(Clone, Debug)]
struct FreeList {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
    member: Vec<bool>,
}

impl FreeList {
    fn full(n: usize) -> Self {
        let n32 = n as u32;
        Self {
            prev: (0..n32)
                .map(|i| if i == 0 { NONE } else { i - 1 })
                .collect(),
            next: (0..n32)
                .map(|i| if i + 1 == n32 { NONE } else { i + 1 })
                .collect(),
            head: if n == 0 { NONE } else { 0 },
            tail: if n == 0 { NONE } else { n32 - 1 },
            len: n,
            member: vec![true; n],
        }
    }

    fn push_back(&mut self, b: u32) {
        debug_assert!(!self.member[b as usize]);
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NONE;
        if self.tail == NONE {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.member[b as usize] = true;
        self.len += 1;
    }

    fn remove(&mut self, b: u32) {
        debug_assert!(self.member[b as usize]);
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NONE {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NONE {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.member[b as usize] = false;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u32> {
        let b = self.head;
        (b != NONE).then(|| {
            self.remove(b);
            b
        })
    }
}

/// A cached prefix found for a sequence: the blocks to reuse and their hashes.
#[derive(Clone, Debug, Default)]
pub struct PrefixHit {
    /// Physical blocks holding the first `blocks.len()` full blocks of the tokens.
    pub blocks: Vec<u32>,
    /// Their chained hashes.
    pub hashes: Vec<u64>,
    /// How many of them sit on the free list (taking them uses free blocks).
    pub num_free: usize,
}

/// Prefix-cache counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens looked up at admission.
    pub queried_tokens: u64,
    /// Of those, tokens served from the cache.
    pub hit_tokens: u64,
}

/// The fixed pool of KV blocks and the prefix cache.
#[derive(Clone, Debug)]
pub struct BlockManager {
    block_size: usize,
    blocks: Vec<Block>,
    free: FreeList,
    cached: HashMap<u64, u32>,
    prefix_caching: bool,
    stats: PrefixCacheStats,
}

impl BlockManager {
    /// A pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        Self {
            block_size,
            blocks: vec![Block::default(); num_blocks],
            free: FreeList::full(num_blocks),
            cached: HashMap::new(),
            prefix_caching,
            stats: PrefixCacheStats::default(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks no sequence holds (cached ones included: they are evictable).
    pub fn num_free_blocks(&self) -> usize {
        self.free.len
    }

    /// Fraction of the pool held by sequences.
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.free.len as f64 / self.blocks.len() as f64
    }

    /// Prefix-cache counters.
    pub fn stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// The chained hash of a block of `tokens` following a block of hash `prev`.
    pub fn hash_block(prev: Option<u64>, tokens: &[u32]) -> u64 {
        let mut h = Xxh3::new();
        h.update(&prev.unwrap_or(0).to_le_bytes());
        h.update(&[prev.is_some() as u8]);
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        h.digest()
    }

    /// The longest cached prefix of `tokens` in full blocks that still leaves at least one
    /// token to compute (the step that computes it samples the next token).
    pub fn find_prefix(&self, tokens: &[u32]) -> PrefixHit {
        let mut hit = PrefixHit::default();
        if !self.prefix_caching || tokens.is_empty() {
            return hit;
        }
        let max_blocks = (tokens.len() - 1) / self.block_size;
        let mut prev = None;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let h = Self::hash_block(prev, chunk);
            let Some(&b) = self.cached.get(&h) else { break };
            if self.blocks[b as usize].token_ids != chunk {
                break;
            }
            hit.blocks.push(b);
            hit.hashes.push(h);
            hit.num_free += (self.blocks[b as usize].ref_count == 0) as usize;
            prev = Some(h);
        }
        hit
    }

    /// Free blocks a sequence with no blocks needs to start computing `chunk` tokens past
    /// `hit`.
    pub fn blocks_to_admit(&self, hit: &PrefixHit, chunk: usize) -> usize {
        let cached = hit.blocks.len() * self.block_size;
        self.blocks_for(cached + chunk) - hit.blocks.len() + hit.num_free
    }

    /// Free blocks a running sequence needs to compute its next `chunk` tokens.
    pub fn blocks_to_grow(&self, seq: &Sequence, chunk: usize) -> usize {
        self.blocks_for(seq.num_computed_tokens + chunk)
            .saturating_sub(seq.block_table.len())
    }

    /// Starts a waiting sequence: takes the `hit` blocks (its cached prefix) and fresh blocks
    /// for `chunk` more tokens. The caller checked [`Self::blocks_to_admit`] against
    /// [`Self::num_free_blocks`].
    pub fn admit(&mut self, seq: &mut Sequence, hit: PrefixHit, chunk: usize) {
        assert!(
            seq.block_table.is_empty(),
            "admitting a sequence that holds blocks"
        );
        self.stats.queried_tokens += seq.num_tokens() as u64;
        let cached_tokens = hit.blocks.len() * self.block_size;
        self.stats.hit_tokens += cached_tokens as u64;
        for &b in &hit.blocks {
            let block = &mut self.blocks[b as usize];
            if block.ref_count == 0 {
                self.free.remove(b);
            }
            block.ref_count += 1;
        }
        seq.block_table = hit.blocks;
        seq.block_hashes = hit.hashes;
        seq.num_computed_tokens = cached_tokens;
        seq.num_cached_tokens = cached_tokens;
        self.grow(seq, chunk);
    }

    /// Adds fresh blocks so that `seq` can compute its next `chunk` tokens. The caller checked
    /// [`Self::blocks_to_grow`] against [`Self::num_free_blocks`].
    pub fn grow(&mut self, seq: &mut Sequence, chunk: usize) {
        let need = self.blocks_for(seq.num_computed_tokens + chunk);
        while seq.block_table.len() < need {
            let b = self
                .free
                .pop_front()
                .expect("grow: checked against the free count");
            let block = &mut self.blocks[b as usize];
            debug_assert_eq!(block.ref_count, 0);
            if let Some(h) = block.hash.take() {
                if self.cached.get(&h) == Some(&b) {
                    self.cached.remove(&h);
                }
                block.token_ids.clear();
            }
            block.ref_count = 1;
            seq.block_table.push(b);
        }
    }

    /// Registers the sequence's blocks that are now full of computed tokens in the prefix
    /// cache (a block whose prefix another block already holds stays unregistered).
    pub fn cache_full_blocks(&mut self, seq: &mut Sequence) {
        if !self.prefix_caching {
            return;
        }
        let full = seq.num_computed_tokens / self.block_size;
        while seq.block_hashes.len() < full {
            let i = seq.block_hashes.len();
            let tokens = &seq.token_ids[i * self.block_size..(i + 1) * self.block_size];
            let h = Self::hash_block(seq.block_hashes.last().copied(), tokens);
            seq.block_hashes.push(h);
            let b = seq.block_table[i];
            if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(h) {
                e.insert(b);
                let block = &mut self.blocks[b as usize];
                block.hash = Some(h);
                block.token_ids = tokens.to_vec();
            }
        }
    }

    /// Releases every block of `seq` (last block first, so that a sequence's tail is evicted
    /// before its head) and resets its cache state.
    pub fn free(&mut self, seq: &mut Sequence) {
        for &b in seq.block_table.iter().rev() {
            let block = &mut self.blocks[b as usize];
            assert!(block.ref_count > 0, "double free of block {b}");
            block.ref_count -= 1;
            if block.ref_count == 0 {
                self.free.push_back(b);
            }
        }
        seq.block_table.clear();
        seq.block_hashes.clear();
        seq.num_computed_tokens = 0;
    }

    /// The reference count of block `b` (for tests and checks).
    pub fn ref_count(&self, b: u32) -> u32 {
        self.blocks[b as usize].ref_count
    }

    /// Checks the pool's invariants against the block tables of every live sequence: each
    /// block's count equals the tables holding it, the free list holds exactly the unheld
    /// blocks, and every registered hash points at a block registered under it.
    pub fn check_invariants<'a>(
        &self,
        tables: impl IntoIterator<Item = &'a [u32]>,
    ) -> Result<(), String> {
        let mut counts = vec![0u32; self.blocks.len()];
        for table in tables {
            for &b in table {
                counts[b as usize] += 1;
            }
        }
        for (b, block) in self.blocks.iter().enumerate() {
            if block.ref_count != counts[b] {
                return Err(format!(
                    "block {b}: ref count {} but {} tables hold it",
                    block.ref_count, counts[b]
                ));
            }
            if self.free.member[b] != (block.ref_count == 0) {
                return Err(format!(
                    "block {b}: ref count {} and on the free list: {}",
                    block.ref_count, self.free.member[b]
                ));
            }
        }
        let listed = {
            let mut n = 0;
            let mut b = self.free.head;
            while b != NONE {
                n += 1;
                b = self.free.next[b as usize];
            }
            n
        };
        if listed != self.free.len {
            return Err(format!(
                "free list walks {listed} blocks, counts {}",
                self.free.len
            ));
        }
        for (&h, &b) in &self.cached {
            if self.blocks[b as usize].hash != Some(h) {
                return Err(format!(
                    "hash {h:x} maps to block {b}, registered otherwise"
                ));
            }
        }
        Ok(())
    }
}
