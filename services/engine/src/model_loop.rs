//! The model thread: continuous batching, wired from four parts. Each step applies
//! commands (an abort frees the request's blocks at once), lets the [`Scheduler`] plan,
//! runs the plan on the [`ModelRunner`], lets the [`sampler`](crate::sampler) choose
//! each fully computed sequence's next token (where the logits are, when it can), and
//! hands it to the [`OutputProcessor`]. Parked sibling choices fork from their leader
//! when its prompt is computed and sample from the same logits.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Instant;

use mmserve_arena::ArenaView;
use mmserve_models::MropePositions;
use mmserve_protocol::{FinishReason, GenerateRequest, RequestTiming, TokenLogprobs};

use crate::masks::{AdvanceJob, MaskJob, MaskPool, apply_on_device};
use crate::output::{Detok, OutputProcessor};
use crate::runner::{Batch, BatchSeq, ModelRunner};
use crate::sampler::{Next, Pick, SamplingState, next_tokens, pick};
use crate::scheduler::{Planned, Scheduler, Seq};
use crate::service::Counts;

pub enum Command {
    /// One request's choices, in order, each with its constraint's matcher if it has one.
    Submit(Vec<(GenerateRequest, Option<mmserve_grammar::Matcher>)>),
    Abort(u64),
    /// The embed cache restarted: read rows from its new arenas from now on.
    Remap(Arc<ArenaView>),
}

/// What the loop keeps per sequence beside the scheduler's bookkeeping.
pub struct SeqState {
    pub sampling: SamplingState,
    pub detok: Detok,
    /// The prompt's multimodal positions (Qwen-VL), as the model takes them.
    pub mrope: Option<MropePositions>,
    pub clock: SeqClock,
}

/// When a sequence arrived, was first scheduled and gave its first token: the
/// [`RequestTiming`] its last event carries.
pub struct SeqClock {
    arrived: Instant,
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
    cached_tokens: u64,
}

impl SeqClock {
    pub fn new() -> Self {
        SeqClock { arrived: Instant::now(), scheduled: None, first_token: None, cached_tokens: 0 }
    }

    /// In a step's plan with `computed` tokens already in the pool: the first time, those
    /// came from the prefix cache.
    fn scheduled(&mut self, now: Instant, computed: usize) {
        if self.scheduled.is_none() {
            self.scheduled = Some(now);
            self.cached_tokens = computed as u64;
        }
    }

    /// A token was chosen; a choice forked from a sibling was never planned itself: its
    /// whole prompt came from the sibling.
    fn token(&mut self, now: Instant, prompt_len: usize) -> RequestTiming {
        self.scheduled(now, prompt_len);
        let first = *self.first_token.get_or_insert(now);
        let scheduled = self.scheduled.unwrap_or(now);
        RequestTiming {
            queued_s: (scheduled - self.arrived).as_secs_f64(),
            prefill_s: (first - scheduled).as_secs_f64(),
            decode_s: (now - first).as_secs_f64(),
            cached_tokens: self.cached_tokens,
        }
    }
}

impl Default for SeqClock {
    fn default() -> Self {
        Self::new()
    }
}

/// A constrained row's token mask made for the step, if it has one.
type Mask = Option<Vec<u32>>;

pub struct ModelLoop<R> {
    pub runner: R,
    pub sched: Scheduler<SeqState>,
    pub output: OutputProcessor,
    pub counts: Arc<Counts>,
    pub masks: MaskPool,
}

fn restarted() -> FinishReason {
    FinishReason::Retry("the embed cache restarted; retry the request".into())
}

impl<R: ModelRunner> ModelLoop<R> {
    /// Runs until the command channel closes.
    pub fn run(mut self, commands: Receiver<Command>) {
        self.publish();
        loop {
            // Idle: block until there is work (a notification, not a poll).
            if self.sched.is_idle() {
                match commands.recv() {
                    Ok(cmd) => self.apply(cmd),
                    Err(_) => return,
                }
            }
            loop {
                match commands.try_recv() {
                    Ok(cmd) => self.apply(cmd),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            self.step();
            self.publish();
        }
    }

    fn publish(&self) {
        let (s, b) = (&self.sched, self.sched.blocks());
        self.counts.set(s.running().len(), s.num_waiting());
        self.counts.set_kv(b.stats().hit_tokens, b.num_used_blocks(), b.num_blocks());
        self.counts.set_sched(s.stats());
    }

    pub fn apply(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(choices) => {
                for (req, grammar) in choices {
                    // Submitted against arenas that a Remap has since replaced: cannot run.
                    if !req.items.is_empty() && req.cache_instance != self.runner.arena_instance() {
                        self.output.finish(&req, restarted());
                        continue;
                    }
                    let eos = self.output.tokenizer.eos_ids();
                    let sampling = SamplingState::new(&req, self.runner.vocab_size(), eos).with_grammar(grammar);
                    let detok = Detok::new(&req);
                    let mrope =
                        req.positions.as_ref().map(|p| MropePositions { prompt: p.streams.clone(), delta: p.delta });
                    self.sched.submit(Seq::new(req, SeqState { sampling, detok, mrope, clock: SeqClock::new() }));
                }
            }
            Command::Remap(view) => {
                // On failure, requests for the new arenas finish with a retry (instance differs).
                if let Err(e) = self.runner.remap(view) {
                    tracing::error!(error = %e, "mapping the embed cache's new arenas");
                }
                // Requests with prompt rows still to read refer to the old arenas: they cannot run.
                let instance = self.runner.arena_instance();
                let stale = self.sched.remove_where(|s| {
                    !s.req.items.is_empty() && s.req.cache_instance != instance && s.computed() < s.req.prompt_ids.len()
                });
                for seq in stale.into_iter().flat_map(Seq::into_group) {
                    self.output.finish(&seq.req, restarted());
                }
            }
            Command::Abort(id) => {
                if let Some(seq) = self.sched.abort(id) {
                    self.output.finish(&seq.req, FinishReason::Abort);
                }
            }
        }
    }

    /// One scheduled forward, then sampling and events.
    pub fn step(&mut self) {
        let t0 = Instant::now();
        let step = self.sched.schedule();
        for seq in step.rejected {
            let why = "the request needs more KV cache than --kv-cache-memory holds";
            self.output.finish(&seq.req, FinishReason::Error(why.into()));
        }
        let plan = step.plan;
        let schedule_time = t0.elapsed();
        if plan.is_empty() {
            return;
        }
        let running = self.sched.running();
        let prefill: usize = plan
            .iter()
            .map(|p| p.n.min(running[p.index].req.prompt_ids.len().saturating_sub(running[p.index].computed())))
            .sum();
        let now = Instant::now();
        for p in &plan {
            let seq = &mut self.sched.running_mut()[p.index];
            let computed = seq.computed();
            seq.state.clock.scheduled(now, computed);
        }
        let (next, masks) = match self.forward(&plan) {
            Ok(next) => next,
            Err(message) => {
                tracing::error!("forward step failed: {message}");
                for seq in self.sched.drain_running().into_iter().flat_map(Seq::into_group) {
                    self.output.finish(&seq.req, FinishReason::Error(message.clone()));
                }
                return;
            }
        };
        // Every row's token first; then the constrained rows' matchers follow their tokens
        // side by side; then each token is published (a complete constraint ends its row).
        let mut chosen = Vec::with_capacity(plan.len());
        for ((planned, next), mask) in plan.iter().zip(next).zip(masks) {
            if !self.sched.advance(planned) {
                continue; // a prefill chunk short of the prompt's end
            }
            for f in self.sched.fork_followers(planned.index) {
                chosen.push(self.choose(f, next.clone(), None));
            }
            chosen.push(self.choose(planned.index, next, mask.as_deref()));
        }
        self.advance_constraints(&chosen);
        let mut finished = Vec::new();
        for (index, token, logprobs) in chosen {
            if self.publish_token(index, token, logprobs) {
                finished.push(index);
            }
        }
        self.sched.finish(finished);
        self.counts.stepped(prefill, schedule_time, t0.elapsed());
    }

    /// The plan on the runner, then where each row's next token comes from, with the
    /// constraint masks made for the step (made while the model ran).
    fn forward(&mut self, plan: &[Planned]) -> Result<(Vec<Next>, Vec<Mask>), String> {
        let on_device = self.runner.samples_on_device();
        let running = self.sched.running();
        let picks: Vec<Pick> = plan
            .iter()
            .map(|p| {
                let s = &running[p.index];
                let emits = s.computed() + p.n >= s.num_tokens();
                let siblings = s.followers().iter().map(|f| (&f.req.params, &f.state.sampling));
                pick(&s.req.params, &s.state.sampling, siblings, emits, on_device)
            })
            .collect();
        // Constrained rows that emit alone lend their matchers to the mask pool (a row with
        // siblings is masked per sibling on the host, when it is chosen).
        let mut jobs = Vec::new();
        for (row, p) in plan.iter().enumerate() {
            let s = &mut self.sched.running_mut()[p.index];
            if s.computed() + p.n >= s.num_tokens()
                && s.followers().is_empty()
                && let Some(m) = s.state.sampling.grammar.take()
            {
                jobs.push(MaskJob::new(row, m));
            }
        }
        let logits = self.run_batch(plan, &mut jobs);
        let mut masks = vec![None; plan.len()];
        for mut job in jobs {
            masks[job.row] = job.take_mask();
            self.sched.running_mut()[plan[job.row].index].state.sampling.grammar = Some(job.matcher);
        }
        let logits = apply_on_device(logits?, &picks, &masks)?;
        Ok((next_tokens(&logits, &picks).map_err(|e| e.to_string())?, masks))
    }

    /// The model on the plan, while the jobs' masks are made.
    fn run_batch(&mut self, plan: &[Planned], jobs: &mut [MaskJob]) -> Result<candle_core::Tensor, String> {
        let running = self.sched.running();
        let mut batch = Batch { seqs: Vec::with_capacity(plan.len()), copies: Vec::new() };
        for p in plan {
            let seq = &running[p.index];
            batch.seqs.push(BatchSeq {
                prompt_ids: &seq.req.prompt_ids,
                items: &seq.req.items,
                output: &seq.output,
                start: seq.computed(),
                n: p.n,
                block_table: self.sched.block_table(p.index)?,
                mrope: seq.state.mrope.as_ref(),
            });
            batch.copies.extend(p.copy);
        }
        let runner = &mut self.runner;
        self.masks.overlap(jobs, || runner.forward(&batch))
    }

    /// Chooses running sequence `index`'s next token from `next`; its constraint, if any,
    /// follows in [`advance_constraints`](Self::advance_constraints).
    fn choose(&mut self, index: usize, next: Next, mask: Option<&[u32]>) -> (usize, u32, Option<TokenLogprobs>) {
        let seq = &mut self.sched.running_mut()[index];
        let (token, logprobs) = seq.state.sampling.choose_unadvanced(&seq.req.params, next, mask);
        (index, token, logprobs)
    }

    /// The constrained sequences among `chosen` advance their matchers by their tokens, on
    /// the mask pool.
    fn advance_constraints(&mut self, chosen: &[(usize, u32, Option<TokenLogprobs>)]) {
        let running = self.sched.running_mut();
        let mut jobs: Vec<AdvanceJob> = chosen
            .iter()
            .filter_map(|&(index, token, _)| {
                running[index].state.sampling.grammar.take().map(|m| AdvanceJob::new(index, token, m))
            })
            .collect();
        if jobs.is_empty() {
            return;
        }
        self.masks.advance(&mut jobs);
        for job in jobs {
            let sampling = &mut running[job.index].state.sampling;
            sampling.grammar = Some(job.matcher);
            sampling.advanced(job.outcome);
        }
    }

    /// Publishes running sequence `index`'s chosen token. Returns whether the sequence
    /// finished.
    fn publish_token(&mut self, index: usize, token: u32, logprobs: Option<TokenLogprobs>) -> bool {
        let seq = &mut self.sched.running_mut()[index];
        seq.output.push(token);
        // A constraint that is complete ends the sequence as a stop token would.
        let stop_token = seq.state.sampling.stop_ids.contains(&token) || seq.state.sampling.constraint_done;
        let timing = seq.state.clock.token(Instant::now(), seq.req.prompt_ids.len());
        let step = crate::output::Step { token, logprobs, generated: seq.output.len(), stop_token, timing };
        self.output.token(&seq.req, &mut seq.state.detok, step)
    }
}

#[cfg(test)]
mod tests;
