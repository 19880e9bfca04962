//! The scheduler: which sequences compute how many tokens in the next model step, with
//! their KV blocks reserved. Pure bookkeeping over [`BlockManager`]: no model, no
//! tokenizer, no device, so its tests run thousands of steps a second.
//!
//! Each [`schedule`](Scheduler::schedule): admit waiting requests first come, first
//! served while the token-budget rule of [`Admission`] holds and fewer than
//! `max_running` run (a new sequence starts with the prompt's cached prefix from the
//! prefix cache, so its prefill starts after it); plan every decode plus prefill chunks
//! of at most `chunked_prefill_size` tokens in all (a chunk may split an image's rows);
//! reserve the blocks, preempting the most recently admitted request when the pool runs
//! out (its blocks are freed and it goes back to the front of the line, to be
//! recomputed, its output so far kept).
//!
//! Choices `1..n` of a request (`sibling_of`) wait parked in choice 0 (the leader) until
//! its prompt is computed; then [`fork_followers`](Scheduler::fork_followers) gives each
//! a fork of the leader's blocks (the partly filled last block is copied on first
//! write), so the prompt is prefilled once for all `n`.
//!
//! `T` is what the caller keeps per sequence (sampling and detokenizing state); the
//! scheduler only carries it.

use std::collections::VecDeque;
use std::ops::Range;

use mmserve_protocol::GenerateRequest;

use crate::admission::{Admission, Need, OutputLengths};
use crate::kv::{BlockCopy, BlockId, BlockManager, KvError, SeqId};

/// Scheduling settings (`--max-running-requests`, `--chunked-prefill-size`,
/// `--expected-output-tokens`).
#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    pub max_running: usize,
    /// Most tokens computed in one step (decodes included; every decode always runs).
    pub chunked_prefill_size: usize,
    /// The output length admission assumes, set by the operator. `None`: estimated from
    /// recently finished requests while the pool is not busy, else the full `max_tokens`
    /// (so a busy pool is never over-committed).
    pub expected_output: Option<u64>,
}

/// Pool use from which admission stops trusting estimates (LightLLM's "busy").
const BUSY_RATIO: f64 = 0.85;

/// Counters since the scheduler was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedStats {
    pub preemptions: u64,
    pub forks: u64,
}

/// One request's choice as the scheduler tracks it.
pub struct Seq<T> {
    pub req: GenerateRequest,
    /// Tokens generated so far (the caller appends).
    pub output: Vec<u32>,
    pub state: T,
    /// The block manager's sequence while running; `None` while waiting.
    kv: Option<SeqId>,
    /// Tokens (prompt, then output) whose keys and values are in the pool.
    computed: usize,
    /// Admission order: larger is more recent.
    admitted: u64,
    /// Sibling choices waiting for this sequence's prompt to be computed.
    followers: Vec<Seq<T>>,
}

impl<T> Seq<T> {
    pub fn new(req: GenerateRequest, state: T) -> Self {
        Seq { req, output: Vec::new(), state, kv: None, computed: 0, admitted: 0, followers: Vec::new() }
    }

    /// Prompt and output tokens.
    pub fn num_tokens(&self) -> usize {
        self.req.prompt_ids.len() + self.output.len()
    }

    /// Tokens whose keys and values are in the pool.
    pub fn computed(&self) -> usize {
        self.computed
    }

    /// Parked sibling choices (they sample from this sequence's first logits).
    pub fn followers(&self) -> &[Seq<T>] {
        &self.followers
    }

    /// Whether this sequence holds KV blocks.
    pub fn holds_blocks(&self) -> bool {
        self.kv.is_some()
    }

    /// This sequence and its parked followers, for finishing them all.
    pub fn into_group(mut self) -> Vec<Seq<T>> {
        let mut group = std::mem::take(&mut self.followers);
        group.insert(0, self);
        group
    }

    /// Prompt ids then output ids, the prefix cache's keys.
    fn token_ids(&self) -> Vec<u64> {
        self.req.prompt_ids.iter().copied().chain(self.output.iter().map(|&t| u64::from(t))).collect()
    }
}

/// One running sequence's share of a step: `n` tokens from its `computed()`, after `copy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    /// Index into [`Scheduler::running`].
    pub index: usize,
    pub n: usize,
    pub copy: Option<BlockCopy>,
}

/// What [`Scheduler::schedule`] decided.
pub struct Step<T> {
    pub plan: Vec<Planned>,
    /// Sequences that alone need more KV cache than the pool holds (submit refuses
    /// these; belt and braces): the caller finishes them with an error.
    pub rejected: Vec<Seq<T>>,
}

pub struct Scheduler<T> {
    blocks: BlockManager,
    cfg: SchedulerConfig,
    /// Output lengths of recently finished requests.
    lengths: OutputLengths,
    waiting: VecDeque<Seq<T>>,
    /// In admission order between steps.
    running: Vec<Seq<T>>,
    order: u64,
    stats: SchedStats,
}

impl<T> Scheduler<T> {
    pub fn new(blocks: BlockManager, cfg: SchedulerConfig) -> Self {
        let cfg = SchedulerConfig {
            max_running: cfg.max_running.max(1),
            chunked_prefill_size: cfg.chunked_prefill_size.max(1),
            ..cfg
        };
        Scheduler {
            blocks,
            cfg,
            lengths: OutputLengths::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            order: 0,
            stats: SchedStats::default(),
        }
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn running(&self) -> &[Seq<T>] {
        &self.running
    }

    pub fn running_mut(&mut self) -> &mut [Seq<T>] {
        &mut self.running
    }

    pub fn waiting(&self) -> impl Iterator<Item = &Seq<T>> {
        self.waiting.iter()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    pub fn stats(&self) -> SchedStats {
        self.stats
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Records a finished request's output length for the admission estimate (a test
    /// may seed it).
    pub fn record_length(&mut self, len: u64) {
        self.lengths.record(len);
    }

    /// Queues `seq`; a sibling choice parks in its leader while that has not started
    /// generating.
    pub fn submit(&mut self, seq: Seq<T>) {
        let leader = seq.req.sibling_of.and_then(|id| {
            self.waiting
                .iter_mut()
                .chain(self.running.iter_mut())
                .find(|l| l.req.id == id && l.output.is_empty() && l.req.prompt_ids == seq.req.prompt_ids)
        });
        match leader {
            Some(leader) => leader.followers.push(seq),
            None => self.waiting.push_back(seq),
        }
    }

    /// Removes request `id` (waiting, running or parked), its blocks freed. Its parked
    /// followers go on without it, as requests of their own.
    pub fn abort(&mut self, id: u64) -> Option<Seq<T>> {
        let seq = if let Some(pos) = self.waiting.iter().position(|s| s.req.id == id) {
            self.waiting.remove(pos)
        } else if let Some(pos) = self.running.iter().position(|s| s.req.id == id) {
            Some(self.running.remove(pos))
        } else {
            // A parked follower holds nothing yet.
            self.waiting.iter_mut().chain(self.running.iter_mut()).find_map(|l| {
                let pos = l.followers.iter().position(|f| f.req.id == id)?;
                Some(l.followers.remove(pos))
            })
        };
        let mut seq = seq?;
        for f in std::mem::take(&mut seq.followers).into_iter().rev() {
            self.waiting.push_front(f);
        }
        self.release(&mut seq);
        Some(seq)
    }

    /// Removes every waiting or running sequence for which `gone` holds, blocks freed
    /// (with their parked followers inside: see [`Seq::into_group`]).
    pub fn remove_where(&mut self, gone: impl Fn(&Seq<T>) -> bool) -> Vec<Seq<T>> {
        let (old, keep): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.waiting).into_iter().partition(&gone);
        self.waiting = keep;
        let (old_running, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running).into_iter().partition(&gone);
        self.running = keep;
        let mut removed: Vec<Seq<T>> = old.into_iter().chain(old_running).collect();
        for seq in &mut removed {
            self.release(seq);
        }
        removed
    }

    /// Admits, then plans the next step.
    pub fn schedule(&mut self) -> Step<T> {
        let mut rejected = Vec::new();
        self.admit(&mut rejected);
        Step { plan: self.plan(), rejected }
    }

    /// After the step ran: `p`'s tokens are computed (full blocks enter the prefix
    /// cache). Returns whether the sequence is now fully computed, so that it samples.
    pub fn advance(&mut self, p: &Planned) -> bool {
        let seq = &mut self.running[p.index];
        seq.computed += p.n;
        if let Some(id) = seq.kv
            && let Err(e) = self.blocks.commit_full_blocks(id, &seq.token_ids()[..seq.computed])
        {
            tracing::warn!("prefix cache: {e}");
        }
        seq.computed >= seq.num_tokens()
    }

    /// The prompt of running sequence `index` is computed: its parked followers start
    /// from it, forking its blocks (before its first token is written into the shared
    /// last block), as far as admission allows (they may have arrived after it was
    /// admitted); the others wait at the front, to reuse its full blocks through the
    /// prefix cache. Returns the forked followers' indices in [`running`](Self::running).
    pub fn fork_followers(&mut self, index: usize) -> Range<usize> {
        let start = self.running.len();
        let followers = std::mem::take(&mut self.running[index].followers);
        if followers.is_empty() {
            return start..start;
        }
        let (leader_kv, computed) = (self.running[index].kv, self.running[index].computed);
        let expected = self.expected_output();
        let held: Vec<Need> = self.running.iter().map(|s| self.need(s, expected)).collect();
        let block = self.blocks.block_size() as u64;
        let wanted: Vec<Need> = followers.iter().map(|f| self.follower_need(f, expected, block)).collect();
        let admissible = self.admission().admit(&held, &wanted);
        let mut followers = followers.into_iter();
        for mut f in followers.by_ref().take(admissible) {
            let Some(kv) = leader_kv.and_then(|id| self.blocks.fork(id).ok()) else {
                self.waiting.push_front(f);
                continue;
            };
            f.kv = Some(kv);
            f.computed = computed;
            self.order += 1;
            f.admitted = self.order;
            self.stats.forks += 1;
            self.running.push(f);
        }
        for f in followers.rev() {
            self.waiting.push_front(f);
        }
        start..self.running.len()
    }

    /// Running sequences `indices` are done: removed, blocks freed, output lengths
    /// recorded for admission's estimate.
    pub fn finish(&mut self, mut indices: Vec<usize>) -> Vec<Seq<T>> {
        indices.sort_unstable();
        indices.dedup();
        let mut done = Vec::with_capacity(indices.len());
        for i in indices.into_iter().rev() {
            let mut seq = self.running.remove(i);
            // `ignore_eos` lengths say nothing about where outputs end by themselves.
            if !seq.req.params.ignore_eos {
                self.lengths.record(seq.output.len() as u64);
            }
            self.release(&mut seq);
            done.push(seq);
        }
        done
    }

    /// Every running sequence, blocks freed (after a failed step).
    pub fn drain_running(&mut self) -> Vec<Seq<T>> {
        let mut all = std::mem::take(&mut self.running);
        for seq in &mut all {
            self.release(seq);
        }
        all
    }

    /// The block table of running sequence `index`.
    pub fn block_table(&self, index: usize) -> Result<&[BlockId], String> {
        let id = self.running[index].kv.ok_or("a planned sequence holds no blocks")?;
        self.blocks.block_table(id).map_err(|e| e.to_string())
    }

    /// The output length admission may assume now (see [`SchedulerConfig::expected_output`]).
    pub fn expected_output(&self) -> Option<u64> {
        let b = &self.blocks;
        let busy = b.num_used_blocks() as f64 >= BUSY_RATIO * b.num_blocks() as f64;
        self.cfg.expected_output.or_else(|| if busy { None } else { self.lengths.estimate() })
    }

    /// Direct access to the block manager, for tests that fill the pool.
    #[cfg(test)]
    pub fn blocks_mut(&mut self) -> &mut BlockManager {
        &mut self.blocks
    }

    fn need(&self, seq: &Seq<T>, expected: Option<u64>) -> Need {
        let p = &seq.req.params;
        let (prompt, generated) = (seq.req.prompt_ids.len() as u64, seq.output.len() as u64);
        // `ignore_eos` runs to `max_tokens`: the learned estimate does not apply (the
        // operator's fixed one does, as documented on the flag).
        let expected = if p.ignore_eos && self.cfg.expected_output.is_none() { None } else { expected };
        Need::new(prompt, generated, u64::from(p.max_tokens), expected)
    }

    /// A parked follower shares the prompt's blocks and holds one of its own (the copy
    /// of the partly filled last block).
    fn follower_need(&self, f: &Seq<T>, expected: Option<u64>, block: u64) -> Need {
        Need { held: block, remaining: self.need(f, expected).remaining }
    }

    fn admission(&self) -> Admission {
        Admission {
            pool_tokens: self.blocks.pool_tokens() as u64,
            max_running: self.cfg.max_running,
            slack: self.blocks.block_size() as u64 - 1,
        }
    }

    /// Admits waiting requests (FCFS) while the batch fits the pool; groups (a sequence
    /// and its followers) whole.
    fn admit(&mut self, rejected: &mut Vec<Seq<T>>) {
        loop {
            if self.waiting.is_empty() || self.running.len() >= self.cfg.max_running {
                return;
            }
            let expected = self.expected_output();
            let held: Vec<Need> = self.running.iter().map(|s| self.need(s, expected)).collect();
            let room = self.cfg.max_running - self.running.len();
            let block = self.blocks.block_size() as u64;
            let mut wanted: Vec<Need> = Vec::new();
            let mut group_ends: Vec<usize> = Vec::new();
            for seq in self.waiting.iter() {
                if wanted.len() >= room {
                    break;
                }
                wanted.push(self.need(seq, expected));
                wanted.extend(seq.followers.iter().map(|f| self.follower_need(f, expected, block)));
                group_ends.push(wanted.len());
            }
            let admitted = self.admission().admit(&held, &wanted);
            let k = group_ends.iter().take_while(|&&end| end <= admitted).count();
            if k == 0 && self.running.is_empty() {
                let Some(mut seq) = self.waiting.pop_front() else { return };
                if seq.followers.is_empty() {
                    rejected.push(seq);
                    return;
                }
                // The group does not fit at once: its choices run one after another,
                // sharing the prompt's full blocks through the prefix cache.
                for f in std::mem::take(&mut seq.followers).into_iter().rev() {
                    self.waiting.push_front(f);
                }
                self.waiting.push_front(seq);
                continue;
            }
            for mut seq in self.waiting.drain(..k).collect::<Vec<_>>() {
                let (id, cached) = self.blocks.new_seq(&seq.token_ids());
                seq.kv = Some(id);
                seq.computed = cached;
                self.order += 1;
                seq.admitted = self.order;
                self.running.push(seq);
            }
            return;
        }
    }

    fn release(&mut self, seq: &mut Seq<T>) {
        if let Some(id) = seq.kv.take()
            && let Err(e) = self.blocks.free(id)
        {
            tracing::error!("freeing KV blocks: {e}");
        }
        seq.computed = 0;
    }

    /// Frees the most recently admitted running sequence's blocks and puts it back at
    /// the front of the line (`running` is in admission order, so it is the last).
    fn preempt(&mut self) {
        if let Some(mut seq) = self.running.pop() {
            self.release(&mut seq);
            self.stats.preemptions += 1;
            tracing::debug!(request = seq.req.id, "preempted: out of KV blocks");
            self.waiting.push_front(seq);
        }
    }

    /// Which sequences compute how many tokens this step, with their blocks reserved.
    fn plan(&mut self) -> Vec<Planned> {
        self.running.sort_by_key(|s| s.admitted);
        let todo = |s: &Seq<T>| s.num_tokens() - s.computed;
        // Decodes first (each always runs), then prefill chunks in admission order.
        let mut order: Vec<usize> = (0..self.running.len()).filter(|&i| todo(&self.running[i]) == 1).collect();
        let decodes = order.len();
        order.extend((0..self.running.len()).filter(|&i| todo(&self.running[i]) > 1));
        // At least one prefill token per step, however many decode.
        let mut budget = self.cfg.chunked_prefill_size.saturating_sub(decodes).max(1);
        let mut plan: Vec<Planned> = Vec::new();
        for index in order {
            if index >= self.running.len() {
                continue; // preempted meanwhile
            }
            let left = todo(&self.running[index]);
            let n = if left == 1 {
                1
            } else {
                let n = left.min(budget);
                if n == 0 {
                    continue;
                }
                budget -= n;
                n
            };
            while let Some(id) = self.running[index].kv {
                match self.blocks.allocate(id, n) {
                    Ok(copy) => {
                        plan.push(Planned { index, n, copy });
                        break;
                    }
                    Err(KvError::OutOfBlocks { .. }) => {
                        let victim = self.running.len() - 1;
                        plan.retain(|p| p.index != victim);
                        self.preempt();
                        if victim == index {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::error!("reserving KV blocks: {e}");
                        break;
                    }
                }
            }
        }
        plan
    }
}

#[cfg(test)]
mod tests;
