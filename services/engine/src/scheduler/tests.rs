//! The scheduler on its own, no model: randomised load (lengths, `max_tokens`, aborts,
//! preemptions, sibling choices) against its invariants, thousands of steps a second.
//! A "step" here computes nothing: each fully computed sequence gets a made-up token.

use std::collections::HashMap;

use mmserve_protocol::{GenerateRequest, SamplingParams};

use super::{Scheduler, SchedulerConfig, Seq};
use crate::kv::BlockManager;
use crate::sampler::Rng;

#[derive(Debug, Clone, PartialEq)]
enum End {
    Stop,
    Length,
    Abort,
    Rejected,
}

struct Sim {
    s: Scheduler<()>,
    rng: Rng,
    /// How each request ended, and its output length then.
    ended: HashMap<u64, (End, usize)>,
    /// Prefill budget violations are checked against this.
    chunk: usize,
}

impl Sim {
    fn new(num_blocks: usize, block_size: usize, cfg: SchedulerConfig, seed: u64) -> Self {
        let blocks = BlockManager::new(num_blocks, block_size).expect("blocks");
        Sim {
            s: Scheduler::new(blocks, cfg),
            rng: Rng::new(seed),
            ended: HashMap::new(),
            chunk: cfg.chunked_prefill_size,
        }
    }

    fn end(&mut self, seq: &Seq<()>, how: End) {
        let previous = self.ended.insert(seq.req.id, (how, seq.output.len()));
        assert!(previous.is_none(), "request {} ended twice", seq.req.id);
    }

    fn abort(&mut self, id: u64) {
        if let Some(seq) = self.s.abort(id) {
            assert!(seq.followers().is_empty(), "an aborted leader keeps its followers");
            self.end(&seq, End::Abort);
        }
    }

    /// A made-up token; whether the sequence ends with it.
    fn emit(&mut self, index: usize) -> bool {
        let token = 3 + (self.rng.next_u64() % 1000) as u32;
        let stop = self.rng.next_u64().is_multiple_of(7);
        let seq = &mut self.s.running_mut()[index];
        seq.output.push(token);
        assert!(seq.output.len() <= seq.req.params.max_tokens as usize, "past max_tokens");
        seq.output.len() == seq.req.params.max_tokens as usize || (stop && !seq.req.params.ignore_eos)
    }

    fn tick(&mut self) {
        let step = self.s.schedule();
        for seq in step.rejected {
            self.end(&seq, End::Rejected);
        }
        let cfg = *self.s.config();
        assert!(self.s.running().len() <= cfg.max_running, "more running than max_running");
        // The plan: distinct sequences, blocks reserved for every planned token, decodes
        // always, prefill within the budget.
        let running = self.s.running();
        let mut seen = std::collections::HashSet::new();
        let (mut decodes, mut prefill) = (0, 0);
        for p in &step.plan {
            assert!(seen.insert(p.index), "sequence planned twice");
            let seq = &running[p.index];
            assert!(p.n >= 1 && seq.computed() + p.n <= seq.num_tokens(), "plans past the sequence");
            let table = self.s.block_table(p.index).expect("planned without blocks");
            assert!(table.len() * self.s.blocks().block_size() >= seq.computed() + p.n, "tokens without slots");
            if seq.num_tokens() - seq.computed() == 1 {
                decodes += 1;
            } else {
                prefill += p.n;
            }
        }
        let decoding = running.iter().filter(|s| s.num_tokens() - s.computed() == 1).count();
        assert_eq!(decodes, decoding, "a decode was left out");
        assert!(prefill <= self.chunk.saturating_sub(decodes).max(1), "prefill {prefill} over the budget");
        let mut finished = Vec::new();
        for p in &step.plan {
            if !self.s.advance(p) {
                continue;
            }
            for f in self.s.fork_followers(p.index) {
                assert_eq!(self.s.running()[f].computed(), self.s.running()[p.index].computed());
                if self.emit(f) {
                    finished.push(f);
                }
            }
            if self.emit(p.index) {
                finished.push(p.index);
            }
        }
        for seq in self.s.finish(finished) {
            let how = if seq.output.len() == seq.req.params.max_tokens as usize { End::Length } else { End::Stop };
            self.end(&seq, how);
        }
        self.check();
    }

    fn check(&self) {
        let blocks = self.s.blocks();
        blocks.check().unwrap_or_else(|e| panic!("block manager: {e}"));
        let held: usize = (0..self.s.running().len()).map(|i| self.s.block_table(i).expect("held").len()).sum();
        assert!(blocks.num_used_blocks() <= blocks.num_blocks());
        assert!(held >= blocks.num_used_blocks(), "blocks in use that no running sequence holds");
        assert!(self.s.running().iter().all(Seq::holds_blocks), "a running sequence holds no blocks");
        assert!(self.s.waiting().all(|s| !s.holds_blocks()), "a waiting sequence holds blocks");
    }

    fn run(&mut self, max_steps: usize) {
        for _ in 0..max_steps {
            if self.s.is_idle() {
                return;
            }
            self.tick();
        }
        panic!("not idle after {max_steps} steps");
    }
}

fn request(id: u64, prompt_ids: Vec<u64>, params: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        request_id: String::new(),
        id,
        client: 1,
        prompt_ids,
        items: Vec::new(),
        cache_instance: 0,
        params,
        sibling_of: None,
        positions: None,
    }
}

fn submit(s: &mut Scheduler<()>, req: GenerateRequest) {
    s.submit(Seq::new(req, ()));
}

fn random_prompt(rng: &mut Rng, len: usize) -> Vec<u64> {
    // A few distinct prompts' worth of ids, so that prefixes repeat and hit the cache.
    let base = rng.next_u64() % 3;
    (0..len).map(|i| if i < len / 2 { base * 1000 + i as u64 } else { rng.next_u64() % 1000 }).collect()
}

#[test]
fn randomised_scheduling_loses_nothing_and_frees_every_block() {
    let (mut preemptions, mut forks, mut steps) = (0, 0, 0);
    let started = std::time::Instant::now();
    for seed in 0..300u64 {
        let mut rng = Rng::new(seed);
        // A small pool: far less than the load, so admission waits, estimates overshoot
        // and preemption happens.
        let cfg = SchedulerConfig {
            max_running: 2 + (rng.next_u64() % 8) as usize,
            chunked_prefill_size: 1 + (rng.next_u64() % 24) as usize,
            expected_output: (seed % 2 == 0).then_some(2),
        };
        let mut sim = Sim::new(16 + (rng.next_u64() % 24) as usize, 1 + (seed % 8) as usize, cfg, seed);
        let mut submitted: Vec<u64> = Vec::new();
        let mut aborted = Vec::new();
        let mut next_id = 1u64;
        for _round in 0..60 {
            // Submit a few, abort one now and then (waiting, running or a parked sibling).
            for _ in 0..rng.next_u64() % 3 {
                let len = 1 + (rng.next_u64() % 40) as usize;
                let params = SamplingParams {
                    max_tokens: 1 + (rng.next_u64() % 24) as u32,
                    ignore_eos: rng.next_u64().is_multiple_of(2),
                    ..Default::default()
                };
                let prompt = random_prompt(&mut rng, len);
                // What the engine's submit refuses: more than the pool alone.
                let pool = sim.s.blocks().pool_tokens();
                if len + params.max_tokens as usize + sim.s.blocks().block_size() - 1 > pool {
                    continue;
                }
                let choices = 1 + u64::from(rng.next_u64().is_multiple_of(4)) * 2;
                let leader = next_id;
                for c in 0..choices {
                    let mut req = request(next_id, prompt.clone(), params.clone());
                    req.sibling_of = (c > 0).then_some(leader);
                    submitted.push(next_id);
                    submit(&mut sim.s, req);
                    next_id += 1;
                }
            }
            if rng.next_u64().is_multiple_of(4) && next_id > 1 {
                let id = 1 + rng.next_u64() % (next_id - 1);
                aborted.push(id);
                sim.abort(id);
            }
            for _ in 0..1 + rng.next_u64() % 4 {
                sim.tick();
                steps += 1;
            }
        }
        sim.run(20_000);
        assert_eq!(sim.ended.len(), submitted.len(), "seed {seed}: requests lost");
        for id in &submitted {
            match &sim.ended[id] {
                (End::Abort, _) => assert!(aborted.contains(id), "seed {seed}: {id} aborted unasked"),
                (End::Length | End::Stop, _) => {}
                (End::Rejected, _) => panic!("seed {seed}: {id} rejected though it fits the pool alone"),
            }
        }
        let blocks = sim.s.blocks();
        assert_eq!(blocks.num_used_blocks(), 0, "seed {seed}: blocks still held");
        assert_eq!(blocks.num_seqs(), 0, "seed {seed}: sequences still registered");
        preemptions += sim.s.stats().preemptions;
        forks += sim.s.stats().forks;
    }
    assert!(preemptions > 0, "the pool was never exhausted: the test does not exercise preemption");
    assert!(forks > 0, "no sibling choice forked: the test does not exercise sharing");
    eprintln!("{steps} scheduled steps in {:?}", started.elapsed());
}

#[test]
fn aborting_a_leader_lets_its_parked_siblings_run() {
    let cfg = SchedulerConfig { max_running: 8, chunked_prefill_size: 4, expected_output: None };
    let mut sim = Sim::new(64, 8, cfg, 3);
    let prompt = random_prompt(&mut Rng::new(3), 20);
    for i in 0..3u64 {
        let mut req = request(30 + i, prompt.clone(), SamplingParams { max_tokens: 3, ..Default::default() });
        req.sibling_of = (i > 0).then_some(30);
        submit(&mut sim.s, req);
    }
    sim.tick(); // the leader's first chunk; its siblings wait parked in it
    assert_eq!(sim.s.running().len(), 1);
    assert_eq!(sim.s.running()[0].followers().len(), 2);
    sim.abort(30);
    sim.run(100);
    assert_eq!(sim.ended[&30].0, End::Abort);
    assert_ne!(sim.ended[&31].0, End::Abort);
    assert_ne!(sim.ended[&32].0, End::Abort);
    assert_eq!(sim.s.blocks().num_used_blocks(), 0);
}

#[test]
fn siblings_fork_the_computed_prompt() {
    let cfg = SchedulerConfig { max_running: 8, chunked_prefill_size: 64, expected_output: None };
    let mut sim = Sim::new(64, 8, cfg, 1);
    let prompt: Vec<u64> = (0..30).collect();
    let params = SamplingParams { max_tokens: 5, ignore_eos: true, ..Default::default() };
    for i in 0..4u64 {
        let mut req = request(10 + i, prompt.clone(), params.clone());
        req.sibling_of = (i > 0).then_some(10);
        submit(&mut sim.s, req);
    }
    sim.tick();
    assert_eq!(sim.s.running().len(), 4, "all four run after one prefill");
    assert_eq!(sim.s.stats().forks, 3);
    assert!(sim.s.running().iter().all(|s| s.output.len() == 1 && s.computed() == 30));
    sim.run(100);
    assert!((10..14).all(|id| sim.ended[&id] == (End::Length, 5)));
}

#[test]
fn a_request_larger_than_the_pool_is_rejected_not_stuck() {
    let cfg = SchedulerConfig { max_running: 4, chunked_prefill_size: 16, expected_output: None };
    let mut sim = Sim::new(4, 4, cfg, 1);
    submit(&mut sim.s, request(1, (0..40).collect(), SamplingParams { max_tokens: 4, ..Default::default() }));
    submit(&mut sim.s, request(2, (0..4).collect(), SamplingParams { max_tokens: 2, ..Default::default() }));
    sim.run(50);
    assert_eq!(sim.ended[&1].0, End::Rejected);
    assert!(matches!(sim.ended[&2].0, End::Length | End::Stop));
}

#[test]
fn remove_where_frees_the_removed() {
    let cfg = SchedulerConfig { max_running: 4, chunked_prefill_size: 2, expected_output: None };
    let mut sim = Sim::new(32, 4, cfg, 1);
    for id in 0..6u64 {
        submit(&mut sim.s, request(id, (0..10).collect(), SamplingParams { max_tokens: 8, ..Default::default() }));
    }
    sim.tick();
    let removed = sim.s.remove_where(|s| s.req.id % 2 == 0);
    assert_eq!(removed.iter().map(|s| s.req.id).collect::<Vec<_>>(), [4, 0, 2]);
    assert!(removed.iter().all(|s| !s.holds_blocks()));
    sim.check();
    sim.run(500);
    assert_eq!(sim.s.blocks().num_used_blocks(), 0);
}

#[test]
fn admission_estimates_output_from_recent_requests_when_not_busy() {
    let cfg = SchedulerConfig { max_running: 16, chunked_prefill_size: 64, expected_output: None };
    let mut sim = Sim::new(40, 4, cfg, 1);
    assert_eq!(sim.s.expected_output(), None, "no history yet: the full max_tokens");
    for len in [3u64, 4, 5, 5, 6, 6, 6, 7, 8, 20] {
        sim.s.record_length(len);
    }
    assert_eq!(sim.s.expected_output(), Some(8));
    // Prompts of 8 with max_tokens 64: alone each needs 72 + 3 slots, the pool holds 160;
    // with the estimate of 8 several fit at once.
    for id in 0..6u64 {
        let params = SamplingParams { max_tokens: 64, ..Default::default() };
        submit(&mut sim.s, request(100 + id, random_prompt(&mut Rng::new(id), 8), params));
    }
    sim.tick();
    assert!(sim.s.running().len() >= 4, "estimate not used: {} admitted", sim.s.running().len());
    // Busy (most blocks in use): the estimate is off.
    let mut held = Vec::new();
    while (sim.s.blocks().num_used_blocks() as f64) < 0.85 * 40.0 {
        let (id, _) = sim.s.blocks_mut().new_seq(&[]);
        sim.s.blocks_mut().allocate(id, 4).expect("room");
        held.push(id);
    }
    assert_eq!(sim.s.expected_output(), None);
    for id in held {
        sim.s.blocks_mut().free(id).expect("free");
    }
}
