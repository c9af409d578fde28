//! Benchmark workloads, generated exactly as the Python benchmarks generate them.
//!
//! [`PyRandom`] reproduces CPython's `random` module (MT19937 seeded by `init_by_array`,
//! `getrandbits`, `randint` by rejection sampling) so that [`nano_bench`] yields the very
//! prompts and output lengths of nano-vLLM's `bench.py`.

/// CPython's Mersenne Twister (`random.Random`).
pub struct PyRandom {
    state: [u32; 624],
    index: usize,
}

impl PyRandom {
    /// `random.seed(seed)` for a non-negative integer seed: `init_by_array` over the seed's
    /// 32-bit words (`[0]` for 0).
    pub fn new(seed: u64) -> Self {
        let mut key = Vec::new();
        let mut s = seed;
        loop {
            key.push(s as u32);
            s >>= 32;
            if s == 0 {
                break;
            }
        }
        let mut r = Self {
            state: [0; 624],
            index: 624,
        };
        r.init_by_array(&key);
        r
    }

    fn init_genrand(&mut self, s: u32) {
        self.state[0] = s;
        for i in 1..624 {
            let prev = self.state[i - 1];
            self.state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        self.index = 624;
    }

    fn init_by_array(&mut self, key: &[u32]) {
        self.init_genrand(19_650_218);
        let (mut i, mut j) = (1usize, 0usize);
        let n = 624;
        for _ in 0..n.max(key.len()) {
            let prev = self.state[i - 1];
            self.state[i] = (self.state[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= n {
                self.state[0] = self.state[n - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..n - 1 {
            let prev = self.state[i - 1];
            self.state[i] = (self.state[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_566_083_941))
                .wrapping_sub(i as u32);
            i += 1;
            if i >= n {
                self.state[0] = self.state[n - 1];
                i = 1;
            }
        }
        self.state[0] = 0x8000_0000;
    }

    /// The next 32 random bits (`genrand_uint32`).
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= 624 {
            for k in 0..624 {
                let y = (self.state[k] & 0x8000_0000) | (self.state[(k + 1) % 624] & 0x7fff_ffff);
                let mut v = self.state[(k + 397) % 624] ^ (y >> 1);
                if y & 1 == 1 {
                    v ^= 0x9908_b0df;
                }
                self.state[k] = v;
            }
            self.index = 0;
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `getrandbits(k)` for `1 ≤ k ≤ 32`.
    pub fn getrandbits(&mut self, k: u32) -> u32 {
        self.next_u32() >> (32 - k)
    }

    /// `randint(a, b)`: uniform in `[a, b]`, by rejection as CPython draws it.
    pub fn randint(&mut self, a: u32, b: u32) -> u32 {
        let n = b - a + 1;
        let k = 32 - n.leading_zeros();
        loop {
            let r = self.getrandbits(k);
            if r < n {
                return a + r;
            }
        }
    }
}

/// One request of a workload: prompt token ids and the tokens to generate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkItem {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Output tokens (generated with `ignore_eos`).
    pub max_tokens: usize,
}

/// nano-vLLM's `bench.py`: `seed(0)`; for each of `num_seqs` sequences a prompt length
/// `randint(100, max_input_len)` then that many ids `randint(0, 10000)`; then `num_seqs`
/// output lengths `randint(100, max_output_len)`.
pub fn nano_bench(num_seqs: usize, max_input_len: u32, max_output_len: u32) -> Vec<WorkItem> {
    let mut rng = PyRandom::new(0);
    let prompts: Vec<Vec<u32>> = (0..num_seqs)
        .map(|_| {
            let len = rng.randint(100, max_input_len);
            (0..len).map(|_| rng.randint(0, 10_000)).collect()
        })
        .collect();
    prompts
        .into_iter()
        .map(|prompt| WorkItem {
            prompt,
            max_tokens: rng.randint(100, max_output_len) as usize,
        })
        .collect()
}

/// vLLM's random dataset: `n` requests of `input_len` and `output_len` tokens, each scaled by
/// a factor drawn uniformly from [1 − `range_ratio`, 1 + `range_ratio`], ids uniform below
/// `vocab` (at most 10,000, like bench.py's).
pub fn random_requests(
    n: usize,
    input_len: usize,
    output_len: usize,
    range_ratio: f64,
    vocab: u32,
    seed: u64,
) -> Vec<WorkItem> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let scaled = |len: usize, rng: &mut rand::rngs::StdRng| {
        let f = 1.0 + range_ratio * (2.0 * rng.random::<f64>() - 1.0);
        ((len as f64 * f).round() as usize).max(1)
    };
    (0..n)
        .map(|_| {
            let len = scaled(input_len, &mut rng);
            let max_tokens = scaled(output_len, &mut rng);
            let prompt = (0..len)
                .map(|_| rng.random_range(0..vocab.min(10_000)))
                .collect();
            WorkItem { prompt, max_tokens }
        })
        .collect()
}

/// A shared-prefix workload (vLLM's prefix-caching benchmark): one random prefix of
/// `prefix_len` ids, then for each of `n` requests `suffix_len` random ids of its own;
/// `output_len` tokens each. Returns the prefix and the requests.
pub fn shared_prefix_requests(
    n: usize,
    prefix_len: usize,
    suffix_len: usize,
    output_len: usize,
    vocab: u32,
    seed: u64,
) -> (Vec<u32>, Vec<WorkItem>) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut ids = |len: usize| -> Vec<u32> {
        (0..len)
            .map(|_| rng.random_range(0..vocab.min(10_000)))
            .collect()
    };
    let prefix = ids(prefix_len);
    let work = (0..n)
        .map(|_| WorkItem {
            prompt: [prefix.clone(), ids(suffix_len)].concat(),
            max_tokens: output_len,
        })
        .collect();
    (prefix, work)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPython: `random.seed(0); [random.getrandbits(32) for _ in range(3)]`.
    #[test]
    fn matches_cpython_getrandbits() {
        let mut r = PyRandom::new(0);
        assert_eq!(
            [r.next_u32(), r.next_u32(), r.next_u32()],
            [3_626_764_237, 1_654_615_998, 3_255_389_356]
        );
    }

    /// The totals and first draws the nano-vLLM bench.py workload is known by.
    #[test]
    fn nano_bench_workload_matches_bench_py() {
        let w = nano_bench(256, 1024, 1024);
        let prompt: usize = w.iter().map(|x| x.prompt.len()).sum();
        let output: usize = w.iter().map(|x| x.max_tokens).sum();
        assert_eq!(prompt, 142_827);
        assert_eq!(output, 133_966);
        let lens: Vec<usize> = w.iter().take(5).map(|x| x.prompt.len()).collect();
        assert_eq!(lens, [964, 724, 484, 508, 316]);
        let outs: Vec<usize> = w.iter().take(5).map(|x| x.max_tokens).collect();
        assert_eq!(outs, [845, 312, 607, 843, 500]);
    }

    /// vLLM's random dataset: lengths within ± the range ratio, ids below the vocabulary,
    /// the same requests for the same seed.
    #[test]
    fn shared_prefix_requests_share_exactly_the_prefix() {
        let (prefix, work) = shared_prefix_requests(8, 100, 30, 7, 5000, 3);
        assert_eq!(prefix.len(), 100);
        assert_eq!(work.len(), 8);
        for w in &work {
            assert_eq!(w.prompt.len(), 130);
            assert_eq!(&w.prompt[..100], &prefix[..]);
            assert_eq!(w.max_tokens, 7);
            assert!(w.prompt.iter().all(|&t| t < 5000));
        }
        // The suffixes differ (30 random ids out of 5000 never collide in practice).
        assert_ne!(work[0].prompt[100..], work[1].prompt[100..]);
    }

    #[test]
    fn random_requests_keep_their_ranges() {
        let a = random_requests(200, 100, 40, 0.5, 300, 7);
        assert_eq!(a.len(), 200);
        assert!(a.iter().all(|w| (50..=150).contains(&w.prompt.len())));
        assert!(a.iter().all(|w| (20..=60).contains(&w.max_tokens)));
        assert!(a.iter().flat_map(|w| &w.prompt).all(|&t| t < 300));
        let lens: std::collections::HashSet<usize> = a.iter().map(|w| w.prompt.len()).collect();
        assert!(lens.len() > 20, "lengths vary");
        let b = random_requests(200, 100, 40, 0.5, 300, 7);
        assert!(
            a.iter()
                .zip(&b)
                .all(|(x, y)| x.prompt == y.prompt && x.max_tokens == y.max_tokens)
        );
        let fixed = random_requests(5, 64, 8, 0.0, 1000, 1);
        assert!(
            fixed
                .iter()
                .all(|w| w.prompt.len() == 64 && w.max_tokens == 8)
        );
    }
}
