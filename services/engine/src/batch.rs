//! The model thread: a simple continuous batch. Each step admits waiting requests (up
//! to `--max-running-requests`), runs one forward over every running sequence (new ones
//! prefill their whole prompt, the others decode one token), samples, detokenizes and
//! publishes events. The paged KV cache and chunked prefill replace this in the engine
//! issue.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError};

use candle_core::Tensor;
use mmserve_models::{KvCache, Llama, SeqInput};
use mmserve_protocol::{FinishReason, GenerateRequest, OutputEvent};
use mmserve_text::{IncrementalDecoder, TextTokenizer};

use mmserve_embed_cache::ArenaView;

use crate::inputs::embed_prompt;
use crate::outbox::Outbox;
use crate::sampler::{History, Rng, adjust, logprobs, sample};
use crate::stops::StopMatcher;

pub enum Command {
    Submit(Box<GenerateRequest>),
    Abort(u64),
    /// The embed cache restarted: read rows from its new arenas from now on.
    Remap(Box<ArenaView>),
}

struct Sequence {
    req: GenerateRequest,
    cache: KvCache,
    /// Tokens generated so far.
    output: Vec<u32>,
    decoder: IncrementalDecoder,
    stops: StopMatcher,
    history: History,
    rng: Rng,
}

pub struct Batcher {
    pub model: Llama,
    pub tokenizer: TextTokenizer,
    pub arena: ArenaView,
    pub outbox: Arc<Outbox>,
    pub max_running: usize,
    pub counts: Arc<crate::service::Counts>,
}

impl Batcher {
    /// Runs until the command channel closes.
    pub fn run(mut self, commands: Receiver<Command>) {
        let mut waiting: VecDeque<GenerateRequest> = VecDeque::new();
        let mut running: Vec<Sequence> = Vec::new();
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
            while running.len() < self.max_running {
                let Some(req) = waiting.pop_front() else { break };
                let seed = req.params.seed.unwrap_or_else(|| fresh_seed(req.id));
                let vocab = self.model.config().vocab_size as u64;
                let prompt = req.prompt_ids.iter().filter(|&&t| t < vocab).map(|&t| t as u32).collect();
                running.push(Sequence {
                    decoder: IncrementalDecoder::new(req.params.skip_special_tokens),
                    stops: StopMatcher::new(&req.params.stop),
                    history: History { prompt, ..Default::default() },
                    cache: self.model.new_cache(),
                    output: Vec::new(),
                    rng: Rng::new(seed),
                    req,
                });
            }
            self.counts.set(running.len(), waiting.len());
            if !running.is_empty() {
                self.step(&mut running);
            }
            self.counts.set(running.len(), waiting.len());
        }
    }

    fn apply(&mut self, cmd: Command, waiting: &mut VecDeque<GenerateRequest>, running: &mut Vec<Sequence>) {
        match cmd {
            Command::Submit(req) => {
                // Submitted against arenas that a Remap has since replaced: cannot run.
                if !req.items.is_empty() && req.cache_instance != self.arena.info.instance {
                    let reason = FinishReason::Retry("the embed cache restarted; retry the request".into());
                    self.outbox.push(req.client, [finish_event(req.id, reason)]);
                } else {
                    waiting.push_back(*req);
                }
            }
            Command::Remap(view) => {
                self.arena = *view;
                // Requests not yet prefilled refer to the old arenas: they cannot run.
                let instance = self.arena.info.instance;
                let (keep, stale): (VecDeque<_>, VecDeque<_>) =
                    std::mem::take(waiting).into_iter().partition(|r| r.cache_instance == instance);
                *waiting = keep;
                for req in stale {
                    let reason = FinishReason::Retry("the embed cache restarted; retry the request".into());
                    self.outbox.push(req.client, [finish_event(req.id, reason)]);
                }
            }
            Command::Abort(id) => {
                let client = if let Some(pos) = waiting.iter().position(|r| r.id == id) {
                    waiting.remove(pos).map(|r| r.client)
                } else {
                    running.iter().position(|s| s.req.id == id).map(|pos| running.swap_remove(pos).req.client)
                };
                if let Some(client) = client {
                    self.outbox.push(client, [finish_event(id, FinishReason::Abort)]);
                }
            }
        }
    }

    /// One forward over every running sequence, then sampling and events.
    fn step(&self, running: &mut Vec<Sequence>) {
        let logits = match self.forward(running) {
            Ok(l) => l,
            Err(message) => {
                tracing::error!("forward step failed: {message}");
                for seq in running.drain(..) {
                    self.outbox.push(seq.req.client, [finish_event(seq.req.id, FinishReason::Error(message.clone()))]);
                }
                return;
            }
        };
        let mut finished = Vec::new();
        for (i, (seq, mut row)) in running.iter_mut().zip(logits).enumerate() {
            let p = &seq.req.params;
            let mut stop_ids: Vec<u32> = p.stop_token_ids.clone();
            if !p.ignore_eos {
                stop_ids.extend_from_slice(self.tokenizer.eos_ids());
            }
            let raw = p.logprobs.map(|_| row.clone());
            adjust(&mut row, p, &seq.history, &stop_ids);
            let token = sample(&row, p, &mut seq.rng);
            let lps = raw.map(|raw| logprobs(&raw, token, usize::from(p.logprobs.unwrap_or(0).min(20))));
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
            if finish.is_some() {
                finished.push(i);
            }
            let event = OutputEvent { request_id: seq.req.id, token_id: Some(token), logprobs: lps, text, finish };
            self.outbox.push(seq.req.client, [event]);
        }
        for i in finished.into_iter().rev() {
            running.swap_remove(i);
        }
    }

    /// Logits of each sequence's last position, one row per sequence.
    fn forward(&self, running: &mut [Sequence]) -> Result<Vec<Vec<f32>>, String> {
        let mut embeds = Vec::with_capacity(running.len());
        for seq in running.iter() {
            let e = if seq.cache.is_empty() {
                embed_prompt(&self.model, &self.arena, &seq.req.prompt_ids, &seq.req.items)?
            } else {
                let last = *seq.output.last().expect("a decoding sequence has output");
                self.model.embed_tokens(&[last]).map_err(|e| e.to_string())?
            };
            embeds.push(e);
        }
        let lens: Vec<usize> = embeds.iter().map(|e| e.dim(0).unwrap_or(0)).collect();
        let input = Tensor::cat(&embeds, 0).map_err(|e| e.to_string())?;
        let mut seqs: Vec<SeqInput<'_>> =
            running.iter_mut().zip(lens).map(|(s, n)| SeqInput { new_tokens: n, cache: &mut s.cache }).collect();
        let logits = self.model.forward(&input, &mut seqs, false).map_err(|e| e.to_string())?;
        logits.to_vec2::<f32>().map_err(|e| e.to_string())
    }
}

fn finish_event(request_id: u64, reason: FinishReason) -> OutputEvent {
    OutputEvent { request_id, token_id: None, logprobs: None, text: String::new(), finish: Some(reason) }
}

/// A seed for requests that give none: differs per request and per run.
fn fresh_seed(id: u64) -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    Rng::new(nanos ^ id.rotate_left(32)).next_u64()
}
