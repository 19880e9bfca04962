//! Tests of the block manager: hand-checked cases, then a randomised model with a shadow
//! KV store that checks every written slot is private and every hit has the right content.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use proptest::prelude::*;

use super::*;

const IMG: u64 = 1 << 32;

fn prompt(parts: &[&[u64]]) -> Vec<u64> {
    parts.concat()
}

/// New sequence for `tokens`, allocated and committed as if its prefill ran.
fn prefill(m: &mut BlockManager, tokens: &[u64]) -> (SeqId, usize) {
    let (seq, cached) = m.new_seq(tokens);
    m.allocate(seq, tokens.len() - cached).unwrap();
    m.commit_full_blocks(seq, tokens).unwrap();
    m.check().unwrap();
    (seq, cached)
}

#[test]
fn budget() {
    // 2 · 32 · 8 · 128 · 2 · 16 = 2 MiB per block.
    assert_eq!(blocks_for_budget(1 << 30, 32, 8, 128, 2, 16), 512);
    assert_eq!(blocks_for_budget((1 << 30) - 1, 32, 8, 128, 2, 16), 511);
    assert_eq!(blocks_for_budget(1 << 30, 0, 8, 128, 2, 16), 0);
    assert_eq!(blocks_for_budget(u64::MAX, usize::MAX, usize::MAX, usize::MAX, 2, 16), 0);
}

#[test]
fn hash_is_fixed_and_keyed_by_everything() {
    // A golden value: no per-process state, same in every build.
    assert_eq!(block_hash(ROOT_HASH, &[1, 2, 3, 4]), block_hash(ROOT_HASH, &[1, 2, 3, 4]));
    assert_eq!(block_hash(ROOT_HASH, &[1, 2, 3, 4]), 0xb3e5aae23a1edd5c);
    assert_ne!(block_hash(ROOT_HASH, &[1, 2, 3, 4]), block_hash(ROOT_HASH, &[1, 2, 4, 3]));
    assert_ne!(block_hash(ROOT_HASH, &[IMG + 7]), block_hash(ROOT_HASH, &[IMG + 8]));
    assert_ne!(block_hash(ROOT_HASH, &[IMG]), block_hash(ROOT_HASH, &[0]));
    assert_ne!(block_hash(ROOT_HASH, &[5]), block_hash(ROOT_HASH ^ 1, &[5]));
    assert_ne!(block_hash(ROOT_HASH, &[0]), block_hash(ROOT_HASH, &[0, 0]));
}

#[test]
fn errors_not_panics() {
    assert_eq!(BlockManager::new(4, 0).unwrap_err(), KvError::ZeroBlockSize);
    let mut m = BlockManager::new(4, 4).unwrap();
    let (s, _) = m.new_seq(&[]);
    assert_eq!(m.allocate(s, 17), Err(KvError::OutOfBlocks { needed: 5, available: 4 }));
    assert_eq!(m.num_tokens(s), Ok(0));
    assert_eq!(m.num_available_blocks(), 4);
    m.allocate(s, 6).unwrap();
    assert_eq!(m.commit_full_blocks(s, &[0; 7]), Err(KvError::TooManyTokens { seq: s, given: 7, held: 6 }));
    assert_eq!(m.slot(s, 5), Ok(Some(m.block_table(s).unwrap()[1] as usize * 4 + 1)));
    assert_eq!(m.slot(s, 6), Ok(None));
    m.free(s).unwrap();
    assert_eq!(m.free(s), Err(KvError::UnknownSeq(s)));
    assert_eq!(m.fork(s), Err(KvError::UnknownSeq(s)));
    assert_eq!(m.allocate(s, 1), Err(KvError::UnknownSeq(s)));
    assert_eq!(m.ensure_writable_last_block(s), Err(KvError::UnknownSeq(s)));
    assert!(m.block_table(s).is_err());
    m.check().unwrap();
}

#[test]
fn shared_prefix_shares_exactly_those_blocks() {
    let mut m = BlockManager::new(32, 4).unwrap();
    let common: Vec<u64> = (100..112).collect(); // 3 full blocks
    let (a, _) = prefill(&mut m, &prompt(&[&common, &[1, 2, 3]]));
    let (b, cached) = prefill(&mut m, &prompt(&[&common, &[4, 5, 6, 7, 8]]));
    assert_eq!(cached, 12);
    let (ta, tb) = (m.block_table(a).unwrap(), m.block_table(b).unwrap());
    assert_eq!(ta[..3], tb[..3]);
    assert_ne!(ta[3], tb[3]);
    for &blk in &ta[..3] {
        assert_eq!(m.block_refs(blk), Some(2));
    }
    assert_eq!((m.stats().hit_blocks, m.stats().hit_tokens), (3, 12));

    // A different image at block 2 shares blocks 0–1 only.
    let img = |id: u64| -> Vec<u64> { (0..4).map(|j| IMG + id * 100 + j).collect() };
    let p1 = prompt(&[&common[..8], &img(1), &[9; 5]]);
    let p2 = prompt(&[&common[..8], &img(2), &[9; 5]]);
    let (c, _) = prefill(&mut m, &p1);
    let before = m.stats();
    let (d, cached) = prefill(&mut m, &p2);
    assert_eq!(cached, 8);
    assert_eq!(m.block_table(c).unwrap()[..2], m.block_table(d).unwrap()[..2]);
    assert_ne!(m.block_table(c).unwrap()[2], m.block_table(d).unwrap()[2]);
    assert_eq!(m.stats().hit_blocks - before.hit_blocks, 2);
    // The same image again shares it.
    let (e, cached) = prefill(&mut m, &p1);
    assert_eq!(cached, 16);
    assert_eq!(m.block_table(e).unwrap()[..4], m.block_table(c).unwrap()[..4]);
    assert!(m.stats().miss_blocks > 0);
    m.check().unwrap();
}

#[test]
fn whole_prompt_hit_leaves_one_block_to_compute() {
    let mut m = BlockManager::new(8, 4).unwrap();
    let p: Vec<u64> = (0..12).collect();
    let (a, cached) = prefill(&mut m, &p);
    assert_eq!(cached, 0);
    let (_, cached) = prefill(&mut m, &p);
    assert_eq!(cached, 8);
    assert_eq!(m.cached_prefix_len(&p), 8);
    assert_eq!(m.cached_prefix_len(&p[..9]), 8);
    assert_eq!(m.cached_prefix_len(&p[..8]), 4);
    // The recomputed duplicate of block 2 is not registered twice.
    assert_eq!(m.num_cached_blocks(), 3);
    m.free(a).unwrap();
    m.check().unwrap();
}

#[test]
fn cached_blocks_survive_free_and_are_evicted_lru() {
    let mut m = BlockManager::new(4, 2).unwrap();
    let (a, _) = prefill(&mut m, &[1, 2, 3, 4, 5]); // 2 full blocks + 1
    m.free(a).unwrap();
    assert_eq!((m.num_available_blocks(), m.num_cached_blocks()), (4, 2));
    let (b, cached) = m.new_seq(&[1, 2, 3, 4, 9]);
    assert_eq!(cached, 4);
    assert_eq!(m.num_available_blocks(), 2);
    m.free(b).unwrap();
    // Fill the pool: the cached blocks are evicted, the tail (1, 2 → 3, 4) first.
    let (c, _) = m.new_seq(&[]);
    m.allocate(c, 6).unwrap();
    assert_eq!(m.stats().evictions, 1);
    assert_eq!(m.cached_prefix_len(&[1, 2, 3, 4, 9]), 2);
    m.allocate(c, 2).unwrap();
    assert_eq!(m.stats().evictions, 2);
    assert_eq!(m.cached_prefix_len(&[1, 2, 3, 4, 9]), 0);
    assert!(m.allocate(c, 1).is_err());
    m.check().unwrap();
}

#[test]
fn fork_copies_shared_last_block_on_write() {
    let mut m = BlockManager::new(8, 4).unwrap();
    let (a, _) = prefill(&mut m, &[1, 2, 3, 4, 5, 6]);
    let b = m.fork(a).unwrap();
    let ta = m.block_table(a).unwrap().to_vec();
    assert_eq!(m.block_table(b).unwrap(), ta);
    assert_eq!(m.block_refs(ta[1]), Some(2));
    m.check().unwrap();
    let copy = m.allocate(b, 1).unwrap().unwrap();
    assert_eq!(copy.src, ta[1]);
    assert_eq!(m.block_table(b).unwrap(), [ta[0], copy.dst]);
    assert_eq!((m.block_refs(ta[0]), m.block_refs(ta[1]), m.block_refs(copy.dst)), (Some(2), Some(1), Some(1)));
    assert_eq!(m.allocate(a, 1), Ok(None));
    assert_eq!(m.ensure_writable_last_block(a), Ok(None));
    assert_eq!(m.stats().copies, 1);
    // A full shared last block needs no copy: the next token opens a new block.
    assert_eq!(m.allocate(a, 1), Ok(None));
    let c = m.fork(a).unwrap();
    assert_eq!(m.ensure_writable_last_block(c), Ok(None));
    assert_eq!(m.allocate(a, 1), Ok(None));
    assert_eq!(m.num_tokens(a), Ok(9));
    assert_eq!(m.stats().copies, 1);
    m.check().unwrap();
}

// ---- randomised model ----

#[derive(Debug, Clone)]
enum Op {
    /// A new request: `shared` tokens of prefix family `family`, then `tail` new tokens
    /// (with an image from a small set when `image` is some), prefilled in `chunk`s.
    Admit {
        family: u8,
        shared: u8,
        tail: u8,
        image: Option<u8>,
        chunk: u8,
    },
    Decode {
        pick: u16,
        steps: u8,
    },
    Fork {
        pick: u16,
    },
    Free {
        pick: u16,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 0u8..48, 0u8..24, prop::option::of(0u8..3), 1u8..20)
            .prop_map(|(family, shared, tail, image, chunk)| Op::Admit { family, shared, tail, image, chunk }),
        4 => (any::<u16>(), 1u8..24).prop_map(|(pick, steps)| Op::Decode { pick, steps }),
        1 => any::<u16>().prop_map(|pick| Op::Fork { pick }),
        2 => any::<u16>().prop_map(|pick| Op::Free { pick }),
    ]
}

/// What the KV of a token "is": a function of the whole prefix up to it, computed
/// independently of the manager's hash.
fn kv_value(prev: u64, token: u64) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (prev, token).hash(&mut h);
    h.finish()
}

struct Model {
    m: BlockManager,
    /// Live sequences in admission order: id, tokens, KV values.
    live: Vec<(SeqId, Vec<u64>, Vec<u64>)>,
    /// Shadow KV store by slot.
    shadow: HashMap<usize, u64>,
    next_token: u64,
}

impl Model {
    fn write(&mut self, seq: SeqId, from: usize, values: &[u64]) {
        let bs = self.m.block_size();
        for (i, &v) in values.iter().enumerate() {
            let pos = from + i;
            let block = self.m.block_table(seq).unwrap()[pos / bs];
            assert_eq!(self.m.block_refs(block), Some(1), "write into a shared block");
            self.shadow.insert(self.m.slot(seq, pos).unwrap().unwrap(), v);
        }
    }

    fn apply(&mut self, copy: Option<BlockCopy>) {
        if let Some(BlockCopy { src, dst }) = copy {
            let bs = self.m.block_size();
            for o in 0..bs {
                match self.shadow.get(&(src as usize * bs + o)).copied() {
                    Some(v) => self.shadow.insert(dst as usize * bs + o, v),
                    None => self.shadow.remove(&(dst as usize * bs + o)),
                };
            }
        }
    }

    /// Allocate `n` slots for `live[i]`, preempting the latest other sequences when the
    /// pool runs out. Returns false (and frees it) when even that is not enough.
    fn allocate(&mut self, i: &mut usize, n: usize) -> bool {
        loop {
            let seq = self.live[*i].0;
            let before = (self.m.num_tokens(seq).unwrap(), self.m.block_table(seq).unwrap().to_vec());
            match self.m.allocate(seq, n) {
                Ok(copy) => {
                    self.apply(copy);
                    return true;
                }
                Err(KvError::OutOfBlocks { .. }) => {
                    // All or nothing.
                    assert_eq!((self.m.num_tokens(seq).unwrap(), self.m.block_table(seq).unwrap().to_vec()), before);
                    let victims = self.live.iter().enumerate().map(|(j, _)| (j, j)).filter(|&(j, _)| j != *i);
                    let Some(v) = crate::admission::choose_victim(victims) else {
                        self.m.free(seq).unwrap();
                        self.live.remove(*i);
                        return false;
                    };
                    self.m.free(self.live.remove(v).0).unwrap();
                    if v < *i {
                        *i -= 1;
                    }
                    self.m.check().unwrap();
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    fn verify(&self) {
        for (seq, tokens, values) in &self.live {
            assert_eq!(self.m.num_tokens(*seq).unwrap(), tokens.len());
            for (pos, v) in values.iter().enumerate() {
                let slot = self.m.slot(*seq, pos).unwrap().unwrap();
                assert_eq!(self.shadow.get(&slot), Some(v), "{seq:?} position {pos}: wrong KV");
            }
        }
        let used: usize = self.m.num_used_blocks();
        assert!(used <= self.m.num_blocks());
    }

    fn step(&mut self, op: Op) {
        let pick = |live: &Vec<_>, p: u16| (!live.is_empty()).then(|| p as usize % live.len());
        match op {
            Op::Admit { family, shared, tail, image, chunk } => {
                let mut tokens: Vec<u64> = (0..shared as u64).map(|j| 1000 * family as u64 + j).collect();
                if family == 1 && tokens.len() > 10 {
                    // Family 1 carries an image in its prefix.
                    tokens[6..10].copy_from_slice(&[IMG + 40, IMG + 41, IMG + 42, IMG + 43]);
                }
                if let Some(img) = image {
                    tokens.extend((0..5).map(|j| IMG + 1000 * (img as u64 + 1) + j));
                }
                for _ in 0..tail {
                    self.next_token += 1;
                    tokens.push(self.next_token);
                }
                if tokens.is_empty() {
                    return;
                }
                let mut values = Vec::with_capacity(tokens.len());
                let mut prev = 0;
                for &t in &tokens {
                    prev = kv_value(prev, t);
                    values.push(prev);
                }
                let expect_cached = self.m.cached_prefix_len(&tokens);
                let (seq, cached) = self.m.new_seq(&tokens);
                assert_eq!(cached, expect_cached);
                assert!(cached < tokens.len() && cached % self.m.block_size() == 0);
                // The hit's content is exactly this prompt's KV.
                for (pos, v) in values[..cached].iter().enumerate() {
                    assert_eq!(self.shadow.get(&self.m.slot(seq, pos).unwrap().unwrap()), Some(v));
                }
                self.live.push((seq, tokens[..cached].to_vec(), values[..cached].to_vec()));
                let mut i = self.live.len() - 1;
                let mut done = cached;
                while done < tokens.len() {
                    let n = (chunk as usize).min(tokens.len() - done);
                    if !self.allocate(&mut i, n) {
                        return;
                    }
                    self.write(seq, done, &values[done..done + n]);
                    done += n;
                    let l = &mut self.live[i];
                    l.1.extend_from_slice(&tokens[done - n..done]);
                    l.2.extend_from_slice(&values[done - n..done]);
                    self.m.commit_full_blocks(seq, &l.1).unwrap();
                    self.m.check().unwrap();
                }
            }
            Op::Decode { pick: p, steps } => {
                let Some(mut i) = pick(&self.live, p) else { return };
                for s in 0..steps {
                    if !self.allocate(&mut i, 1) {
                        return;
                    }
                    // Repeat tokens sometimes, so that decodes can also share blocks.
                    let t = if s % 3 == 0 { 7 } else { self.next_token + 1 };
                    self.next_token += 1;
                    let (seq, tokens, values) = &mut self.live[i];
                    let seq = *seq;
                    let v = kv_value(values.last().copied().unwrap_or(0), t);
                    tokens.push(t);
                    values.push(v);
                    let pos = tokens.len() - 1;
                    self.write(seq, pos, &[v]);
                    let tokens = self.live[i].1.clone();
                    self.m.commit_full_blocks(seq, &tokens).unwrap();
                    self.m.check().unwrap();
                }
            }
            Op::Fork { pick: p } => {
                let Some(i) = pick(&self.live, p) else { return };
                let child = self.m.fork(self.live[i].0).unwrap();
                let (_, t, v) = self.live[i].clone();
                self.live.push((child, t, v));
            }
            Op::Free { pick: p } => {
                let Some(i) = pick(&self.live, p) else { return };
                let (seq, ..) = self.live.remove(i);
                self.m.free(seq).unwrap();
                assert_eq!(self.m.free(seq), Err(KvError::UnknownSeq(seq)));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn random_workload_keeps_invariants(
        block_size in prop_oneof![Just(1usize), Just(3), Just(4), Just(16)],
        pool_tokens in 16usize..256,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let num_blocks = pool_tokens.div_ceil(block_size);
        let m = BlockManager::new(num_blocks, block_size).unwrap();
        let mut model = Model { m, live: Vec::new(), shadow: HashMap::new(), next_token: 1 << 20 };
        for op in ops {
            model.step(op);
            model.m.check().map_err(TestCaseError::fail)?;
            model.verify();
        }
        for (seq, ..) in std::mem::take(&mut model.live) {
            model.m.free(seq).unwrap();
        }
        model.m.check().map_err(TestCaseError::fail)?;
        prop_assert_eq!(model.m.num_seqs(), 0);
        prop_assert_eq!(model.m.num_used_blocks(), 0);
        prop_assert_eq!(model.m.num_available_blocks(), num_blocks);
        // The whole pool can be allocated, evicting the cache.
        let cached = model.m.num_cached_blocks() as u64;
        let evictions = model.m.stats().evictions;
        let (all, _) = model.m.new_seq(&[]);
        prop_assert!(model.m.allocate(all, num_blocks * block_size).is_ok());
        prop_assert_eq!(model.m.stats().evictions - evictions, cached);
        prop_assert_eq!(model.m.num_cached_blocks(), 0);
        prop_assert!(model.m.allocate(all, 1).is_err());
        model.m.check().map_err(TestCaseError::fail)?;
    }
}

proptest! {
    /// Admission with `slack = block_size − 1` never over-commits the paged pool: every
    /// admitted request runs to its `max_tokens` and no allocation fails.
    #[test]
    fn admission_with_slack_never_runs_out(
        block_size in 1usize..9,
        num_blocks in 8usize..64,
        reqs in prop::collection::vec((1usize..40, 1usize..40, 0u8..3), 1..30),
        max_running in 1usize..10,
    ) {
        use crate::admission::{Admission, Need};
        let mut m = BlockManager::new(num_blocks, block_size).unwrap();
        let pool = (num_blocks * block_size) as u64;
        let adm = Admission { pool_tokens: pool, max_running, slack: block_size as u64 - 1 };
        // Prompts of three families share prefixes, so the cache holds blocks to evict.
        let mut waiting: std::collections::VecDeque<(Vec<u64>, usize)> = reqs
            .iter()
            .map(|&(p, max, f)| ((0..p as u64).map(|j| 100 * f as u64 + j).collect::<Vec<u64>>(), max))
            .filter(|(p, max)| (p.len() + max + block_size - 1) as u64 <= pool)
            .collect();
        let (total, mut finished) = (waiting.len(), 0);
        // (seq, tokens, generated, max)
        let mut running: Vec<(SeqId, Vec<u64>, usize, usize)> = Vec::new();
        while !(waiting.is_empty() && running.is_empty()) {
            let need = |p: usize, g: usize, max: usize| Need::new(p as u64, g as u64, max as u64, None);
            let r: Vec<Need> = running.iter().map(|(_, t, g, max)| need(t.len() - g, *g, *max)).collect();
            let w: Vec<Need> = waiting.iter().map(|(p, max)| need(p.len(), 0, *max)).collect();
            for (prompt, max) in waiting.drain(..adm.admit(&r, &w)) {
                let (seq, cached) = m.new_seq(&prompt);
                m.allocate(seq, prompt.len() - cached).map_err(|e| TestCaseError::fail(e.to_string()))?;
                m.commit_full_blocks(seq, &prompt).unwrap();
                running.push((seq, prompt, 0, max));
            }
            for (seq, tokens, g, _) in &mut running {
                m.allocate(*seq, 1).map_err(|e| TestCaseError::fail(e.to_string()))?;
                tokens.push(1 << 40 | tokens.len() as u64);
                *g += 1;
                m.commit_full_blocks(*seq, tokens).unwrap();
            }
            m.check().map_err(TestCaseError::fail)?;
            for (seq, _, g, max) in &running {
                if g == max {
                    m.free(*seq).unwrap();
                    finished += 1;
                }
            }
            running.retain(|(_, _, g, max)| g < max);
        }
        prop_assert_eq!(finished, total);
        prop_assert_eq!(m.num_used_blocks(), 0);
    }
}
