//! The model thread: continuous batching over the paged KV cache.
//!
//! Each step: apply commands (an abort frees the request's blocks at once); admit
//! waiting requests first come, first served while the token-budget rule of
//! [`Admission`] holds and fewer than `--max-running-requests` run (a new sequence
//! starts with the prompt's cached prefix from the prefix cache, so its prefill starts
//! after it); schedule every decode plus prefill chunks of at most
//! `--chunked-prefill-size` tokens in all (a chunk may split an image's rows); reserve
//! the blocks, preempting the most recently admitted request when the pool runs out
//! (its blocks are freed and it goes back to the front of the line, to be recomputed,
//! its output so far kept); run one [`Llama::forward_paged`]; register full blocks in
//! the prefix cache; sample, detokenize and publish events for the sequences whose
//! every token is now computed.
//!
//! Choices `1..n` of a request (`sibling_of`) wait parked in choice 0 (the leader)
//! until its prompt is computed; then each forks the leader's blocks (the partly filled
//! last block is copied on first write) and samples its first token from the same
//! logits, so the prompt is prefilled once for all `n`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use mmserve_models::text_source;
use mmserve_models::{Llama, ModelError, PagedKv, PagedSeq, SampleSettings, argmax_rows, sample_rows};
use mmserve_protocol::{FinishReason, GenerateRequest, OutputEvent};
use mmserve_text::{IncrementalDecoder, TextTokenizer};

use mmserve_arena::ArenaView;

use crate::admission::{Admission, Need, OutputLengths};
use crate::inputs::{ModelArena, prompt_sources};
use crate::kv::{BlockCopy, BlockManager, KvError, SeqId};
use crate::outbox::Outbox;
use crate::sampler::{History, Next, Rng, adjust, argmax_decides, device_samples, device_settings, logprobs, sample};
use crate::stops::StopMatcher;

pub enum Command {
    /// One request's choices, in order.
    Submit(Vec<GenerateRequest>),
    Abort(u64),
    /// The embed cache restarted: read rows from its new arenas from now on.
    Remap(Arc<ArenaView>),
}

struct Sequence {
    req: GenerateRequest,
    /// Tokens generated so far.
    output: Vec<u32>,
    decoder: IncrementalDecoder,
    stops: StopMatcher,
    history: History,
    rng: Rng,
    /// The block manager's sequence while running; `None` while waiting.
    kv: Option<SeqId>,
    /// Tokens (prompt, then output) whose keys and values are in the pool.
    computed: usize,
    /// Admission order: larger is more recent.
    admitted: u64,
    /// Sibling choices waiting for this sequence's prompt to be computed.
    followers: Vec<Sequence>,
}

impl Sequence {
    fn len(&self) -> usize {
        self.req.prompt_ids.len() + self.output.len()
    }

    /// Prompt ids then output ids, the prefix cache's keys.
    fn token_ids(&self) -> Vec<u64> {
        self.req.prompt_ids.iter().copied().chain(self.output.iter().map(|&t| u64::from(t))).collect()
    }
}

/// The KV pool and the scheduling settings of the model thread.
pub struct Scheduler {
    pub kv: PagedKv,
    pub blocks: BlockManager,
    pub max_running: usize,
    /// Most tokens computed in one step (decodes included; every decode always runs).
    pub chunked_prefill_size: usize,
    /// The output length admission assumes, set by the operator. `None`: estimated
    /// from `lengths` while the pool is not busy, else the full `max_tokens` (so a busy
    /// pool is never over-committed).
    pub expected_output: Option<u64>,
    /// Output lengths of recently finished requests.
    pub lengths: OutputLengths,
}

/// Pool use from which admission stops trusting estimates (LightLLM's "busy").
const BUSY_RATIO: f64 = 0.85;

pub struct Batcher {
    pub model: Llama,
    pub tokenizer: TextTokenizer,
    pub arena: ModelArena,
    pub outbox: Arc<Outbox>,
    pub sched: Scheduler,
    pub counts: Arc<crate::service::Counts>,
}

/// One sequence's share of a step: `n` tokens from `computed`, after `copy`.
struct Planned {
    index: usize,
    n: usize,
    copy: Option<BlockCopy>,
}

impl Batcher {
    /// Runs until the command channel closes.
    pub fn run(mut self, commands: Receiver<Command>) {
        let mut waiting: VecDeque<Sequence> = VecDeque::new();
        let mut running: Vec<Sequence> = Vec::new();
        let mut order = 0u64;
        self.publish(&running, &waiting);
        loop {
            // Idle: block until there is work (a notification, not a poll).
            if waiting.is_empty() && running.is_empty() {
                match commands.recv() {
                    Ok(cmd) => self.apply(cmd, &mut waiting, &mut running),
                    Err(_) => return,
                }
            }
            loop {
                match commands.try_recv() {
                    Ok(cmd) => self.apply(cmd, &mut waiting, &mut running),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            let t0 = Instant::now();
            self.admit(&mut waiting, &mut running, &mut order);
            let admit_time = t0.elapsed();
            self.publish(&running, &waiting);
            if !running.is_empty() {
                self.step(&mut running, &mut waiting, &mut order, admit_time);
            }
            self.publish(&running, &waiting);
        }
    }

    fn publish(&self, running: &[Sequence], waiting: &VecDeque<Sequence>) {
        self.counts.set(running.len(), waiting.len());
        let b = &self.sched.blocks;
        self.counts.set_kv(b.stats().hit_tokens, b.num_used_blocks(), b.num_blocks());
    }

    /// The output length admission may assume now (see [`Scheduler::expected_output`]).
    fn expected_output(&self) -> Option<u64> {
        let b = &self.sched.blocks;
        let busy = b.num_used_blocks() as f64 >= BUSY_RATIO * b.num_blocks() as f64;
        self.sched.expected_output.or_else(|| if busy { None } else { self.sched.lengths.estimate() })
    }

    fn need(&self, seq: &Sequence, expected: Option<u64>) -> Need {
        let p = &seq.req.params;
        let (prompt, generated) = (seq.req.prompt_ids.len() as u64, seq.output.len() as u64);
        // `ignore_eos` runs to `max_tokens`: the learned estimate does not apply (the
        // operator's fixed one does, as documented on the flag).
        let expected = if p.ignore_eos && self.sched.expected_output.is_none() { None } else { expected };
        Need::new(prompt, generated, u64::from(p.max_tokens), expected)
    }

    /// A parked follower shares the prompt's blocks and holds one of its own (the copy
    /// of the partly filled last block).
    fn follower_need(&self, f: &Sequence, expected: Option<u64>, block: u64) -> Need {
        Need { held: block, remaining: self.need(f, expected).remaining }
    }

    /// The needs of a waiting sequence and its parked followers.
    fn group_needs(&self, seq: &Sequence, expected: Option<u64>) -> Vec<Need> {
        let mut needs = vec![self.need(seq, expected)];
        let block = self.sched.blocks.block_size() as u64;
        needs.extend(seq.followers.iter().map(|f| self.follower_need(f, expected, block)));
        needs
    }

    /// Admits waiting requests (FCFS) while the batch fits the pool.
    fn admit(&mut self, waiting: &mut VecDeque<Sequence>, running: &mut Vec<Sequence>, order: &mut u64) {
        if waiting.is_empty() || running.len() >= self.sched.max_running {
            return;
        }
        let admission = self.admission();
        let expected = self.expected_output();
        let held: Vec<Need> = running.iter().map(|s| self.need(s, expected)).collect();
        let room = self.sched.max_running - running.len();
        // Groups (a sequence and its followers) are admitted whole.
        let mut wanted: Vec<Need> = Vec::new();
        let mut group_ends: Vec<usize> = Vec::new();
        for seq in waiting.iter() {
            if wanted.len() >= room {
                break;
            }
            wanted.extend(self.group_needs(seq, expected));
            group_ends.push(wanted.len());
        }
        let admitted = admission.admit(&held, &wanted);
        let k = group_ends.iter().take_while(|&&end| end <= admitted).count();
        if k == 0 && running.is_empty() {
            let Some(mut seq) = waiting.pop_front() else { return };
            if !seq.followers.is_empty() {
                // The group does not fit at once: its choices run one after another,
                // sharing the prompt's full blocks through the prefix cache.
                let followers = std::mem::take(&mut seq.followers);
                for f in followers.into_iter().rev() {
                    waiting.push_front(f);
                }
                waiting.push_front(seq);
                return self.admit(waiting, running, order);
            }
            // Alone it does not fit: it never will (submit checks this; belt and braces).
            let reason = FinishReason::Error("the request needs more KV cache than --kv-cache-memory holds".into());
            self.outbox.push(seq.req.client, [finish_event(seq.req.id, reason)]);
            return;
        }
        for mut seq in waiting.drain(..k) {
            let (id, cached) = self.sched.blocks.new_seq(&seq.token_ids());
            seq.kv = Some(id);
            seq.computed = cached;
            *order += 1;
            seq.admitted = *order;
            running.push(seq);
        }
    }

    fn release(&mut self, seq: &mut Sequence) {
        if let Some(id) = seq.kv.take()
            && let Err(e) = self.sched.blocks.free(id)
        {
            tracing::error!("freeing KV blocks: {e}");
        }
        seq.computed = 0;
    }

    fn apply(&mut self, cmd: Command, waiting: &mut VecDeque<Sequence>, running: &mut Vec<Sequence>) {
        match cmd {
            Command::Submit(choices) => {
                for req in choices {
                    // Submitted against arenas that a Remap has since replaced: cannot run.
                    if !req.items.is_empty() && req.cache_instance != self.arena.view.info.instance {
                        let reason = FinishReason::Retry("the embed cache restarted; retry the request".into());
                        self.outbox.push(req.client, [finish_event(req.id, reason)]);
                        continue;
                    }
                    let seq = self.new_sequence(req);
                    match seq.req.sibling_of.and_then(|id| leader_for(&seq, id, waiting, running)) {
                        Some(leader) => leader.followers.push(seq),
                        None => waiting.push_back(seq),
                    }
                }
            }
            Command::Remap(view) => {
                match ModelArena::new(view, self.model.device()) {
                    Ok(arena) => self.arena = arena,
                    // Requests for the new arenas then finish with a retry (instance differs).
                    Err(e) => tracing::error!(error = %e, "mapping the embed cache's new arenas"),
                }
                // Requests with prompt rows still to read refer to the old arenas: they cannot run.
                let instance = self.arena.view.info.instance;
                let stale = |s: &Sequence| {
                    !s.req.items.is_empty() && s.req.cache_instance != instance && s.computed < s.req.prompt_ids.len()
                };
                let mut gone: Vec<Sequence> = Vec::new();
                let (keep, old): (VecDeque<_>, VecDeque<_>) =
                    std::mem::take(waiting).into_iter().partition(|s| !stale(s));
                *waiting = keep;
                gone.extend(old);
                let (keep, old): (Vec<_>, Vec<_>) = std::mem::take(running).into_iter().partition(|s| !stale(s));
                *running = keep;
                gone.extend(old);
                for seq in gone {
                    self.retire(seq, FinishReason::Retry("the embed cache restarted; retry the request".into()));
                }
            }
            Command::Abort(id) => {
                let seq = if let Some(pos) = waiting.iter().position(|s| s.req.id == id) {
                    waiting.remove(pos)
                } else if let Some(pos) = running.iter().position(|s| s.req.id == id) {
                    Some(running.remove(pos))
                } else {
                    // A parked follower holds nothing yet.
                    waiting.iter_mut().chain(running.iter_mut()).find_map(|l| {
                        let pos = l.followers.iter().position(|f| f.req.id == id)?;
                        Some(l.followers.remove(pos))
                    })
                };
                if let Some(mut seq) = seq {
                    // The leader's followers go on without it, as requests of their own.
                    for f in std::mem::take(&mut seq.followers).into_iter().rev() {
                        waiting.push_front(f);
                    }
                    self.retire(seq, FinishReason::Abort);
                }
            }
        }
    }

    /// Frees `seq`'s blocks and finishes it and its followers with `reason`.
    fn retire(&mut self, mut seq: Sequence, reason: FinishReason) {
        self.release(&mut seq);
        for f in std::mem::take(&mut seq.followers) {
            self.outbox.push(f.req.client, [finish_event(f.req.id, reason.clone())]);
        }
        self.outbox.push(seq.req.client, [finish_event(seq.req.id, reason)]);
    }

    fn new_sequence(&self, req: GenerateRequest) -> Sequence {
        let seed = req.params.seed.unwrap_or_else(|| fresh_seed(req.id));
        let vocab = self.model.config().vocab_size as u64;
        let prompt = req.prompt_ids.iter().filter(|&&t| t < vocab).map(|&t| t as u32).collect();
        Sequence {
            decoder: IncrementalDecoder::new(req.params.skip_special_tokens),
            stops: StopMatcher::new(&req.params.stop),
            history: History { prompt, ..Default::default() },
            output: Vec::new(),
            rng: Rng::new(seed),
            kv: None,
            computed: 0,
            admitted: 0,
            followers: Vec::new(),
            req,
        }
    }

    /// Frees the most recently admitted running sequence's blocks and puts it back at
    /// the front of the line (`running` is in admission order, so it is the last).
    fn preempt(&mut self, running: &mut Vec<Sequence>, waiting: &mut VecDeque<Sequence>) {
        if let Some(mut seq) = running.pop() {
            self.release(&mut seq);
            self.counts.preempted();
            tracing::debug!(request = seq.req.id, "preempted: out of KV blocks");
            waiting.push_front(seq);
        }
    }

    /// Which sequences compute how many tokens this step, with their blocks reserved.
    fn plan(&mut self, running: &mut Vec<Sequence>, waiting: &mut VecDeque<Sequence>) -> Vec<Planned> {
        running.sort_by_key(|s| s.admitted);
        // Decodes first (each always runs), then prefill chunks in admission order.
        let mut order: Vec<usize> =
            (0..running.len()).filter(|&i| running[i].len() - running[i].computed == 1).collect();
        order.extend((0..running.len()).filter(|&i| running[i].len() - running[i].computed > 1));
        let decodes = running.iter().filter(|s| s.len() - s.computed == 1).count();
        // At least one prefill token per step, however many decode.
        let mut budget = self.sched.chunked_prefill_size.saturating_sub(decodes).max(1);
        let mut plan: Vec<Planned> = Vec::new();
        for index in order {
            if index >= running.len() {
                continue; // preempted meanwhile
            }
            let todo = running[index].len() - running[index].computed;
            let n = if todo == 1 {
                1
            } else {
                let n = todo.min(budget);
                if n == 0 {
                    continue;
                }
                budget -= n;
                n
            };
            while let Some(id) = running[index].kv {
                match self.sched.blocks.allocate(id, n) {
                    Ok(copy) => {
                        plan.push(Planned { index, n, copy });
                        break;
                    }
                    Err(KvError::OutOfBlocks { .. }) => {
                        let victim = running.len() - 1;
                        plan.retain(|p| p.index != victim);
                        self.preempt(running, waiting);
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

    /// One forward over the planned sequences, then sampling and events.
    fn step(
        &mut self,
        running: &mut Vec<Sequence>,
        waiting: &mut VecDeque<Sequence>,
        order: &mut u64,
        admit_time: Duration,
    ) {
        let t0 = Instant::now();
        let plan = self.plan(running, waiting);
        let schedule_time = admit_time + t0.elapsed();
        if plan.is_empty() {
            return;
        }
        let prefill: usize = plan
            .iter()
            .map(|p| p.n.min(running[p.index].req.prompt_ids.len().saturating_sub(running[p.index].computed)))
            .sum();
        let logits = match self.forward(running, &plan) {
            Ok(l) => l,
            Err(message) => {
                tracing::error!("forward step failed: {message}");
                for seq in std::mem::take(running) {
                    self.retire(seq, FinishReason::Error(message.clone()));
                }
                return;
            }
        };
        let mut finished = Vec::new();
        let mut forked = Vec::new();
        for (planned, row) in plan.iter().zip(logits) {
            let seq = &mut running[planned.index];
            seq.computed += planned.n;
            if let Some(id) = seq.kv
                && let Err(e) = self.sched.blocks.commit_full_blocks(id, &seq.token_ids()[..seq.computed])
            {
                tracing::warn!("prefix cache: {e}");
            }
            if seq.computed < seq.len() {
                continue; // a prefill chunk short of the prompt's end
            }
            // The prompt is computed: parked siblings start from it, before the leader's
            // first token is written into the shared last block, as far as admission
            // allows (they may have arrived after the leader was admitted); the others
            // wait at the front, to reuse its full blocks through the prefix cache.
            let followers = std::mem::take(&mut seq.followers);
            let (leader_kv, computed) = (seq.kv, seq.computed);
            let admissible = self.admissible_followers(running, &forked, &followers);
            let mut followers = followers.into_iter();
            for mut f in followers.by_ref().take(admissible) {
                let Some(kv) = leader_kv.and_then(|id| self.sched.blocks.fork(id).ok()) else {
                    waiting.push_front(f);
                    continue;
                };
                f.kv = Some(kv);
                f.computed = computed;
                *order += 1;
                f.admitted = *order;
                self.counts.forked();
                if !self.emit(&mut f, row.clone()) {
                    forked.push(f);
                } else {
                    self.release(&mut f);
                }
            }
            for f in followers.rev() {
                waiting.push_front(f);
            }
            let seq = &mut running[planned.index];
            if self.emit(seq, row) {
                finished.push(planned.index);
            }
        }
        finished.sort_unstable();
        for i in finished.into_iter().rev() {
            let mut seq = running.remove(i);
            self.release(&mut seq);
        }
        running.extend(forked);
        self.counts.stepped(prefill, schedule_time, t0.elapsed() + admit_time);
    }

    /// How many of `followers` (in order) may fork now beside `running` and `forked`.
    fn admissible_followers(&self, running: &[Sequence], forked: &[Sequence], followers: &[Sequence]) -> usize {
        let expected = self.expected_output();
        let held: Vec<Need> = running.iter().chain(forked).map(|s| self.need(s, expected)).collect();
        let block = self.sched.blocks.block_size() as u64;
        let wanted: Vec<Need> = followers.iter().map(|f| self.follower_need(f, expected, block)).collect();
        self.admission().admit(&held, &wanted)
    }

    fn admission(&self) -> Admission {
        Admission {
            pool_tokens: self.sched.blocks.pool_tokens() as u64,
            max_running: self.sched.max_running,
            slack: self.sched.blocks.block_size() as u64 - 1,
        }
    }

    /// Samples `seq`'s next token from `next` (its last position's logits, or the
    /// device's greedy pick), detokenizes, matches stop strings and publishes the event.
    /// Returns whether `seq` finished.
    fn emit(&mut self, seq: &mut Sequence, next: Next) -> bool {
        let p = &seq.req.params;
        let mut stop_ids: Vec<u32> = p.stop_token_ids.clone();
        if !p.ignore_eos {
            stop_ids.extend_from_slice(self.tokenizer.eos_ids());
        }
        let (token, lps) = match next {
            Next::Greedy(token) => (token, None),
            Next::Sampled(token) => {
                seq.rng.next_f64(); // the draw the device used
                (token, None)
            }
            Next::Logits(mut row) => {
                let raw = p.logprobs.map(|_| row.clone());
                adjust(&mut row, p, &seq.history, &stop_ids);
                let token = sample(&row, p, &mut seq.rng);
                (token, raw.map(|raw| logprobs(&raw, token, usize::from(p.logprobs.unwrap_or(0).min(20)))))
            }
        };
        seq.output.push(token);
        seq.history.push(token);
        let mut finish = if stop_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if seq.output.len() >= p.max_tokens as usize {
            Some(FinishReason::Length)
        } else {
            None
        };
        let decoded = seq.decoder.push(&self.tokenizer, token);
        let matched = seq.stops.push(&decoded);
        let mut text = matched.text;
        if matched.stopped {
            finish = Some(FinishReason::Stop);
        } else if finish.is_some() {
            let tail = seq.decoder.finish(&self.tokenizer);
            let tail = seq.stops.push(&tail);
            text.push_str(&tail.text);
            if tail.stopped {
                finish = Some(FinishReason::Stop);
            } else {
                text.push_str(&seq.stops.finish());
            }
        }
        let done = finish.is_some();
        // `ignore_eos` lengths say nothing about where outputs end by themselves.
        if done && !p.ignore_eos {
            self.sched.lengths.record(seq.output.len() as u64);
        }
        let event = OutputEvent { request_id: seq.req.id, token_id: Some(token), logprobs: lps, text, finish };
        self.outbox.push(seq.req.client, [event]);
        done
    }

    /// Gather sources of positions `from..to` of `seq` (prompt rows, then output tokens).
    fn sources(&self, seq: &Sequence, from: usize, to: usize, out: &mut Vec<i64>) -> Result<(), String> {
        let plen = seq.req.prompt_ids.len();
        if from < plen {
            let vocab = self.model.config().vocab_size;
            prompt_sources(&seq.req.prompt_ids[from..to.min(plen)], vocab, &seq.req.items, out)?;
        }
        if to > plen {
            out.extend(seq.output[from.max(plen) - plen..to - plen].iter().map(|&t| text_source(t)));
        }
        Ok(())
    }

    /// What each planned sequence samples from, one each: the logits of its last
    /// computed position, or only the token chosen where they are (the argmax where it
    /// decides, a device draw where the logits alone decide: [`Pick`]).
    fn forward(&mut self, running: &[Sequence], plan: &[Planned]) -> Result<Vec<Next>, String> {
        let mut sources = Vec::with_capacity(plan.iter().map(|p| p.n).sum());
        let mut tables = Vec::with_capacity(plan.len());
        for p in plan {
            let seq = &running[p.index];
            self.sources(seq, seq.computed, seq.computed + p.n, &mut sources)?;
            let id = seq.kv.ok_or("a planned sequence holds no blocks")?;
            tables.push(self.sched.blocks.block_table(id).map_err(|e| e.to_string())?.to_vec());
        }
        for copy in plan.iter().filter_map(|p| p.copy) {
            self.sched.kv.copy_block(copy.src, copy.dst).map_err(|e| e.to_string())?;
        }
        let seqs: Vec<PagedSeq<'_>> = plan
            .iter()
            .zip(&tables)
            .map(|(p, t)| PagedSeq { start: running[p.index].computed, new_tokens: p.n, block_table: t })
            .collect();
        let input = self.arena.rows.gather(self.model.embed_table(), &sources).map_err(|e| e.to_string())?;
        let logits = self.model.forward_paged(&input, &seqs, &mut self.sched.kv, false).map_err(|e| e.to_string())?;
        let on_gpu = self.model.device().is_cuda();
        let picks: Vec<Pick> = plan
            .iter()
            .map(|p| {
                let s = &running[p.index];
                let (params, history) = (&s.req.params, &s.history);
                // A prefill chunk short of the prompt's end emits nothing: the cheapest pick.
                let short = s.computed + p.n < s.len();
                if short
                    || (argmax_decides(params, history)
                        && s.followers.iter().all(|f| argmax_decides(&f.req.params, &f.history)))
                {
                    Pick::Argmax
                } else if on_gpu && s.followers.is_empty() && device_samples(params, history) {
                    Pick::Draw(device_settings(params, &s.rng))
                } else {
                    Pick::Host
                }
            })
            .collect();
        next_tokens(&logits, &picks).map_err(|e| e.to_string())
    }
}

/// Where a planned row's next token is chosen.
enum Pick {
    /// The argmax, on the logits' device.
    Argmax,
    /// A draw under these settings, on the logits' device.
    Draw(SampleSettings),
    /// On the host, from the whole row (penalties, log-probabilities, siblings…).
    Host,
}

/// Each row's [`Next`] by its [`Pick`]: only ids cross to the host for device picks,
/// whole rows only for the host's.
fn next_tokens(logits: &Tensor, picks: &[Pick]) -> Result<Vec<Next>, ModelError> {
    let rows_of = |want: fn(&Pick) -> bool| -> Vec<u32> {
        (0..picks.len() as u32).filter(|&i| want(&picks[i as usize])).collect()
    };
    let select = |rows: &[u32]| -> candle_core::Result<Tensor> {
        if rows.len() == picks.len() {
            Ok(logits.clone())
        } else {
            logits.index_select(&Tensor::new(rows, logits.device())?, 0)
        }
    };
    let greedy_rows = rows_of(|p| matches!(p, Pick::Argmax));
    let draw_rows = rows_of(|p| matches!(p, Pick::Draw(_)));
    let host_rows = rows_of(|p| matches!(p, Pick::Host));
    let mut argmax = if greedy_rows.is_empty() { Vec::new() } else { argmax_rows(&select(&greedy_rows)?)? }.into_iter();
    let mut drawn = if draw_rows.is_empty() {
        Vec::new()
    } else {
        let settings: Vec<SampleSettings> =
            picks.iter().filter_map(|p| if let Pick::Draw(s) = p { Some(*s) } else { None }).collect();
        sample_rows(&select(&draw_rows)?, &settings)?
    }
    .into_iter();
    let mut host = if host_rows.is_empty() { Vec::new() } else { select(&host_rows)?.to_vec2::<f32>()? }.into_iter();
    Ok(picks
        .iter()
        .map(|p| match p {
            Pick::Argmax => Next::Greedy(argmax.next().unwrap_or_default()),
            Pick::Draw(_) => Next::Sampled(drawn.next().unwrap_or_default()),
            Pick::Host => Next::Logits(host.next().unwrap_or_default()),
        })
        .collect())
}

/// The sequence that a sibling choice of request `leader` may wait in: choice 0 with
/// the same prompt, not yet past its prompt.
fn leader_for<'a>(
    seq: &Sequence,
    leader: u64,
    waiting: &'a mut VecDeque<Sequence>,
    running: &'a mut [Sequence],
) -> Option<&'a mut Sequence> {
    waiting
        .iter_mut()
        .chain(running.iter_mut())
        .find(|l| l.req.id == leader && l.output.is_empty() && l.req.prompt_ids == seq.req.prompt_ids)
}

#[cfg(test)]
mod tests;

fn finish_event(request_id: u64, reason: FinishReason) -> OutputEvent {
    OutputEvent { request_id, token_id: None, logprobs: None, text: String::new(), finish: Some(reason) }
}

/// A seed for requests that give none: differs per request and per run.
fn fresh_seed(id: u64) -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    Rng::new(nanos ^ id.rotate_left(32)).next_u64()
}
