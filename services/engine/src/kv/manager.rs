//! [`BlockManager`]: the pool of KV blocks, the block table of every sequence, reference
//! counts, copy-on-write after [`fork`](BlockManager::fork), and the prefix cache.
//!
//! Every block is in exactly one state:
//! - **free**: no references, no cached content (on the free list);
//! - **cached**: no references, but its full content is registered in the prefix cache
//!   (on the LRU list, and in the hash index): reusable by a matching prompt, evicted
//!   oldest first when the free list is empty;
//! - **referenced**: in the block table of one or more live sequences (refcount = number
//!   of table entries); it may also be registered in the prefix cache.
//!
//! Only full blocks are ever registered, and a full block is never written again, so a
//! registered block's content is immutable. The partly filled last block of a sequence
//! is shared only after a fork; it is copied before the next write
//! ([`ensure_writable_last_block`](BlockManager::ensure_writable_last_block), also done
//! by [`allocate`](BlockManager::allocate)).

use std::collections::{BTreeMap, HashMap};

use super::hash::{ROOT_HASH, block_hash};

/// Index of a block in the pool (`0..num_blocks`), the first dimension of the KV tensors.
pub type BlockId = u32;

/// A sequence of the block manager. Ids are never reused, so a stale id is an error,
/// never another sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(u64);

/// Caller misuse and exhaustion; nothing here panics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("the KV block size must be at least 1")]
    ZeroBlockSize,
    #[error("a pool of {0} KV blocks does not fit 32-bit block ids")]
    TooManyBlocks(usize),
    #[error("unknown KV sequence {0:?} (never created, or already freed)")]
    UnknownSeq(SeqId),
    #[error("out of KV blocks: {needed} needed, {available} available")]
    OutOfBlocks { needed: usize, available: usize },
    #[error("KV sequence {seq:?} holds {held} token slots, not {given}")]
    TooManyTokens { seq: SeqId, given: usize, held: usize },
    #[error("KV sequence {seq:?}: block {index} is shared with different content")]
    ContentMismatch { seq: SeqId, index: usize },
}

/// Copy block `src` into block `dst` (all layers, K and V) before the step writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
}

/// Prefix-cache and pool counters, monotonic since creation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Full prompt blocks found in the cache by [`BlockManager::new_seq`], and their tokens.
    pub hit_blocks: u64,
    pub hit_tokens: u64,
    /// Full prompt blocks looked up and not found (the lookup stops at the first miss:
    /// every block after it counts as a miss too).
    pub miss_blocks: u64,
    /// Cached blocks taken back for new content.
    pub evictions: u64,
    /// Copy-on-write copies handed out.
    pub copies: u64,
}

/// What a registered block holds: enough to confirm a hit exactly.
#[derive(Debug)]
struct Content {
    hash: u64,
    parent: u64,
    tokens: Box<[u64]>,
}

#[derive(Debug, Default)]
struct Block {
    refs: u32,
    content: Option<Content>,
    /// Key in the LRU while cached and unreferenced.
    stamp: u64,
}

#[derive(Debug, Clone)]
struct Seq {
    blocks: Vec<BlockId>,
    tokens: usize,
    /// Chain hashes of the committed full blocks, `hashes[k]` for block `k`.
    hashes: Vec<u64>,
}

/// The block manager. See the module documentation for the states of a block.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    prefix_cache: bool,
    blocks: Vec<Block>,
    free: Vec<BlockId>,
    /// Cached, unreferenced blocks by release time (oldest first).
    lru: BTreeMap<u64, BlockId>,
    /// Hash → registered block (referenced or not).
    index: HashMap<u64, BlockId>,
    seqs: HashMap<SeqId, Seq>,
    next_seq: u64,
    clock: u64,
    stats: KvStats,
}

impl BlockManager {
    /// A pool of `num_blocks` free blocks of `block_size` tokens, prefix cache on.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, KvError> {
        if block_size == 0 {
            return Err(KvError::ZeroBlockSize);
        }
        if u32::try_from(num_blocks).is_err() {
            return Err(KvError::TooManyBlocks(num_blocks));
        }
        Ok(Self {
            block_size,
            prefix_cache: true,
            blocks: (0..num_blocks).map(|_| Block::default()).collect(),
            // Popped from the end: hand out low ids first.
            free: (0..num_blocks as BlockId).rev().collect(),
            lru: BTreeMap::new(),
            index: HashMap::new(),
            seqs: HashMap::new(),
            next_seq: 0,
            clock: 0,
            stats: KvStats::default(),
        })
    }

    /// Turn the prefix cache on or off (off: nothing is matched or registered).
    pub fn with_prefix_cache(mut self, on: bool) -> Self {
        self.prefix_cache = on;
        self
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Token slots in the whole pool.
    pub fn pool_tokens(&self) -> usize {
        self.blocks.len() * self.block_size
    }

    /// Blocks an allocation can take now: free plus cached-unreferenced (evictable).
    pub fn num_available_blocks(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Blocks referenced by live sequences.
    pub fn num_used_blocks(&self) -> usize {
        self.blocks.len() - self.num_available_blocks()
    }

    /// Blocks registered in the prefix cache (referenced or not).
    pub fn num_cached_blocks(&self) -> usize {
        self.index.len()
    }

    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }

    pub fn stats(&self) -> KvStats {
        self.stats
    }

    /// References to `block` (None if out of range).
    pub fn block_refs(&self, block: BlockId) -> Option<u32> {
        self.blocks.get(block as usize).map(|b| b.refs)
    }

    /// The block table of `seq`.
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId], KvError> {
        Ok(&self.seq(seq)?.blocks)
    }

    /// Token slots `seq` holds (allocated, written or about to be).
    pub fn num_tokens(&self, seq: SeqId) -> Result<usize, KvError> {
        Ok(self.seq(seq)?.tokens)
    }

    /// The slot of token `pos` of `seq`: `block · block_size + pos % block_size`
    /// (`None` if `pos` is beyond what the sequence holds).
    pub fn slot(&self, seq: SeqId, pos: usize) -> Result<Option<usize>, KvError> {
        let s = self.seq(seq)?;
        Ok((pos < s.tokens).then(|| s.blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size))
    }

    /// Tokens of `prompt` that [`new_seq`](Self::new_seq) would find cached now, without
    /// taking references or counting (for admission estimates).
    pub fn cached_prefix_len(&self, prompt: &[u64]) -> usize {
        self.lookup(prompt).len() * self.block_size
    }

    /// Start a sequence for `prompt`: the longest chain of cached full blocks that
    /// prefixes it (at most `(len − 1) / block_size` blocks, so at least one prompt token
    /// is left to compute the next token's logits) becomes its block table, with a
    /// reference on each. Returns the sequence and how many tokens are already in the KV
    /// cache (a multiple of the block size); the caller then
    /// [`allocate`](Self::allocate)s the rest. Never fails: it only takes references.
    pub fn new_seq(&mut self, prompt: &[u64]) -> (SeqId, usize) {
        let found = self.lookup(prompt);
        let lookable = if self.prefix_cache { prompt.len().saturating_sub(1) / self.block_size } else { 0 };
        self.stats.hit_blocks += found.len() as u64;
        self.stats.hit_tokens += (found.len() * self.block_size) as u64;
        self.stats.miss_blocks += (lookable - found.len()) as u64;
        for &(id, _) in &found {
            self.take_ref(id);
        }
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        let tokens = found.len() * self.block_size;
        let (blocks, hashes) = found.into_iter().unzip();
        self.seqs.insert(seq, Seq { blocks, tokens, hashes });
        (seq, tokens)
    }

    /// Reserve slots for `n` more tokens of `seq`, all or nothing: appends blocks as
    /// needed (evicting cached blocks LRU when the free list is empty), and, when the
    /// partly filled last block is shared after a fork, replaces it by a private copy
    /// first. The returned copy must be done before the step writes into the block.
    pub fn allocate(&mut self, seq: SeqId, n: usize) -> Result<Option<BlockCopy>, KvError> {
        let s = self.seq(seq)?;
        let new_blocks = (s.tokens + n).div_ceil(self.block_size) - s.blocks.len();
        let copy = n > 0 && self.last_block_shared(s);
        let needed = new_blocks + usize::from(copy);
        let available = self.num_available_blocks();
        if needed > available {
            return Err(KvError::OutOfBlocks { needed, available });
        }
        let copy = if copy { self.ensure_writable_last_block(seq)? } else { None };
        let fresh: Vec<BlockId> = (0..new_blocks).map(|_| self.take_block()).collect();
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq(seq))?;
        s.blocks.extend(fresh);
        s.tokens += n;
        Ok(copy)
    }

    /// If the partly filled last block of `seq` is shared, give `seq` a private copy and
    /// return the copy to perform; `None` when the block is already writable (or full:
    /// full blocks are never written).
    pub fn ensure_writable_last_block(&mut self, seq: SeqId) -> Result<Option<BlockCopy>, KvError> {
        let s = self.seq(seq)?;
        if !self.last_block_shared(s) {
            return Ok(None);
        }
        let src = *s.blocks.last().unwrap_or(&0);
        if self.num_available_blocks() == 0 {
            return Err(KvError::OutOfBlocks { needed: 1, available: 0 });
        }
        let dst = self.take_block();
        // Shared: at least one other reference remains, so `src` stays referenced.
        self.blocks[src as usize].refs -= 1;
        if let Some(s) = self.seqs.get_mut(&seq)
            && let Some(last) = s.blocks.last_mut()
        {
            *last = dst;
        }
        self.stats.copies += 1;
        Ok(Some(BlockCopy { src, dst }))
    }

    /// Register the full blocks of `seq` whose KV is now written: `tokens` are the
    /// sequence's token ids from position 0 (at most the slots it holds); blocks
    /// committed earlier are skipped, so pass the whole sequence every time. A block
    /// whose content is already cached under another id stays private (no duplicate in
    /// the index). Returns how many blocks were newly registered. On
    /// [`KvError::ContentMismatch`] the blocks before the bad one stay committed.
    pub fn commit_full_blocks(&mut self, seq: SeqId, tokens: &[u64]) -> Result<usize, KvError> {
        let bs = self.block_size;
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq(seq))?;
        if tokens.len() > s.tokens {
            return Err(KvError::TooManyTokens { seq, given: tokens.len(), held: s.tokens });
        }
        let mut registered = 0;
        for k in s.hashes.len()..tokens.len() / bs {
            let parent = if k == 0 { ROOT_HASH } else { s.hashes[k - 1] };
            let chunk = &tokens[k * bs..(k + 1) * bs];
            let hash = block_hash(parent, chunk);
            let id = s.blocks[k];
            let block = &mut self.blocks[id as usize];
            match &block.content {
                Some(c) if c.hash != hash => return Err(KvError::ContentMismatch { seq, index: k }),
                Some(_) => {}
                None if !self.prefix_cache || self.index.contains_key(&hash) => {}
                None => {
                    block.content = Some(Content { hash, parent, tokens: chunk.into() });
                    self.index.insert(hash, id);
                    registered += 1;
                }
            }
            s.hashes.push(hash);
        }
        Ok(registered)
    }

    /// A new sequence sharing every block of `seq` (one more reference each); the shared
    /// partly filled last block is copied on the next write of either.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId, KvError> {
        let s = self.seq(seq)?.clone();
        for &id in &s.blocks {
            self.blocks[id as usize].refs += 1;
        }
        let child = SeqId(self.next_seq);
        self.next_seq += 1;
        self.seqs.insert(child, s);
        Ok(child)
    }

    /// Drop `seq` and its references. Blocks left unreferenced become free, or stay
    /// cached (evictable) if registered; the tail is released first, so it is evicted
    /// before the prefix it depends on.
    pub fn free(&mut self, seq: SeqId) -> Result<(), KvError> {
        let s = self.seqs.remove(&seq).ok_or(KvError::UnknownSeq(seq))?;
        for &id in s.blocks.iter().rev() {
            let block = &mut self.blocks[id as usize];
            block.refs -= 1;
            if block.refs == 0 {
                if block.content.is_some() {
                    self.clock += 1;
                    block.stamp = self.clock;
                    self.lru.insert(self.clock, id);
                } else {
                    self.free.push(id);
                }
            }
        }
        Ok(())
    }

    /// Check every invariant (for tests and debugging); the first violation found.
    pub fn check(&self) -> Result<(), String> {
        let n = self.blocks.len();
        let mut refs = vec![0u32; n];
        for (id, s) in &self.seqs {
            if s.blocks.len() != s.tokens.div_ceil(self.block_size) {
                return Err(format!("{id:?}: {} blocks for {} tokens", s.blocks.len(), s.tokens));
            }
            if s.hashes.len() > s.tokens / self.block_size {
                return Err(format!("{id:?}: {} hashes for {} tokens", s.hashes.len(), s.tokens));
            }
            let mut seen = std::collections::HashSet::new();
            for (k, &b) in s.blocks.iter().enumerate() {
                let block = self.blocks.get(b as usize).ok_or(format!("{id:?}: block {b} out of range"))?;
                if !seen.insert(b) {
                    return Err(format!("{id:?}: block {b} twice in its table"));
                }
                refs[b as usize] += 1;
                if let Some(c) = &block.content {
                    if (k + 1) * self.block_size > s.tokens {
                        return Err(format!("{id:?}: partly filled block {b} is registered"));
                    }
                    if s.hashes.get(k).is_some_and(|&h| h != c.hash) {
                        return Err(format!("{id:?}: block {b} registered under another hash"));
                    }
                }
            }
        }
        let mut in_free = vec![false; n];
        for &b in &self.free {
            let slot = in_free.get_mut(b as usize).ok_or(format!("free block {b} out of range"))?;
            if std::mem::replace(slot, true) {
                return Err(format!("block {b} twice on the free list"));
            }
        }
        let mut in_lru = vec![false; n];
        for (&stamp, &b) in &self.lru {
            let slot = in_lru.get_mut(b as usize).ok_or(format!("LRU block {b} out of range"))?;
            if std::mem::replace(slot, true) {
                return Err(format!("block {b} twice in the LRU"));
            }
            if self.blocks[b as usize].stamp != stamp {
                return Err(format!("block {b}: LRU stamp disagrees"));
            }
        }
        let mut registered = 0;
        for (i, block) in self.blocks.iter().enumerate() {
            if block.refs != refs[i] {
                return Err(format!("block {i}: refcount {} but {} table entries", block.refs, refs[i]));
            }
            let state = match (block.refs > 0, &block.content) {
                (true, _) => !in_free[i] && !in_lru[i],
                (false, Some(_)) => !in_free[i] && in_lru[i],
                (false, None) => in_free[i] && !in_lru[i],
            };
            if !state {
                return Err(format!(
                    "block {i}: refs {}, registered {}, free {}, lru {}",
                    block.refs,
                    block.content.is_some(),
                    in_free[i],
                    in_lru[i]
                ));
            }
            if let Some(c) = &block.content {
                registered += 1;
                if self.index.get(&c.hash) != Some(&(i as BlockId)) {
                    return Err(format!("block {i}: not in the index under its hash"));
                }
                if c.tokens.len() != self.block_size || block_hash(c.parent, &c.tokens) != c.hash {
                    return Err(format!("block {i}: content does not match its hash"));
                }
            }
        }
        if registered != self.index.len() {
            return Err(format!("index has {} entries, {registered} blocks registered", self.index.len()));
        }
        let used = refs.iter().filter(|&&r| r > 0).count();
        if self.free.len() + self.lru.len() + used != n {
            return Err(format!("free {} + cached {} + used {used} != {n}", self.free.len(), self.lru.len()));
        }
        Ok(())
    }

    fn seq(&self, seq: SeqId) -> Result<&Seq, KvError> {
        self.seqs.get(&seq).ok_or(KvError::UnknownSeq(seq))
    }

    fn last_block_shared(&self, s: &Seq) -> bool {
        !s.tokens.is_multiple_of(self.block_size) && s.blocks.last().is_some_and(|&b| self.blocks[b as usize].refs > 1)
    }

    /// The chain of cached blocks prefixing `prompt` (capped to leave one token), with
    /// their hashes; every hit is confirmed against the block's stored tokens and parent.
    fn lookup(&self, prompt: &[u64]) -> Vec<(BlockId, u64)> {
        let mut found = Vec::new();
        if !self.prefix_cache {
            return found;
        }
        let mut parent = ROOT_HASH;
        for chunk in prompt[..prompt.len().saturating_sub(1)].chunks_exact(self.block_size) {
            let hash = block_hash(parent, chunk);
            let Some(&id) = self.index.get(&hash) else { break };
            match &self.blocks[id as usize].content {
                Some(c) if c.hash == hash && c.parent == parent && *c.tokens == *chunk => {}
                _ => break,
            }
            found.push((id, hash));
            parent = hash;
        }
        found
    }

    /// One more reference on a block found in the cache (leaving the LRU if it was idle).
    fn take_ref(&mut self, id: BlockId) {
        let block = &mut self.blocks[id as usize];
        if block.refs == 0 {
            self.lru.remove(&block.stamp);
        }
        block.refs += 1;
    }

    /// A block for new content, with one reference: free first, else the oldest cached.
    /// The caller has checked that one is available.
    fn take_block(&mut self) -> BlockId {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let (_, id) = self.lru.pop_first().expect("caller checked availability");
                if let Some(c) = self.blocks[id as usize].content.take() {
                    self.index.remove(&c.hash);
                }
                self.stats.evictions += 1;
                id
            }
        };
        self.blocks[id as usize].refs = 1;
        id
    }
}
