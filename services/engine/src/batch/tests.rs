//! The model thread driven step by step with the tiny fixture LM: randomised
//! scheduling (lengths, `max_tokens`, aborts, preemptions, sibling choices), prefix-cache
//! invariance of the logits, and prompt sharing between choices.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device};
use mmserve_arena::ArenaView;
use mmserve_config::ModelDir;
use mmserve_models::{Llama, PagedKv, Placement};
use mmserve_protocol::{ArenaDtype, ArenaInfo, FinishReason, GenerateRequest, OutputEvent, SamplingParams};
use mmserve_shm::Segment;
use mmserve_text::TextTokenizer;

use super::{Batcher, Command, Scheduler, Sequence};
use crate::admission::OutputLengths;
use crate::kv::BlockManager;
use crate::outbox::Outbox;
use crate::sampler::Rng;
use crate::service::Counts;

const CLIENT: u64 = 7;

fn model_dir() -> ModelDir {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/models/llava-tiny");
    ModelDir::open(&dir).expect("fixture model")
}

/// A model thread without its thread: the test calls `tick` for each step.
struct Harness {
    b: Batcher,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    order: u64,
    /// The (unused) arenas that text-only requests never read; unlinked on drop.
    _arenas: (Segment, Segment),
}

struct Setup {
    num_blocks: usize,
    block_size: usize,
    chunk: usize,
    max_running: usize,
    expected_output: Option<u64>,
}

impl Harness {
    fn new(s: Setup) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = model_dir();
        let model = Llama::load(&dir, &Placement::cpu()).expect("model");
        let tokenizer = TextTokenizer::from_dir(&dir).expect("tokenizer");
        let hidden = model.config().hidden_size as u32;
        let name = format!("mmserve-batchtest-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let embed = Segment::create(&format!("{name}.arena"), hidden as usize * 4).expect("arena");
        let data = Segment::create(&format!("{name}.data"), 4096).expect("data");
        let info = ArenaInfo {
            instance: 1,
            embed_segment: format!("{name}.arena"),
            slots: 1,
            layers: 1,
            hidden,
            dtype: ArenaDtype::F32,
            data_segment: format!("{name}.data"),
            data_bytes: 4096,
        };
        let arena = ArenaView::open(&info).expect("view");
        let kv = PagedKv::new(&model, s.num_blocks, s.block_size, DType::F32).expect("pool");
        let b = Batcher {
            model,
            tokenizer,
            arena: crate::inputs::ModelArena::new(std::sync::Arc::new(arena), &Device::Cpu).expect("arena"),
            outbox: Arc::new(Outbox::default()),
            sched: Scheduler {
                kv,
                blocks: BlockManager::new(s.num_blocks, s.block_size).expect("blocks"),
                max_running: s.max_running,
                chunked_prefill_size: s.chunk,
                expected_output: s.expected_output,
                lengths: OutputLengths::new(),
            },
            counts: Arc::new(Counts::default()),
        };
        Harness { b, waiting: VecDeque::new(), running: Vec::new(), order: 0, _arenas: (embed, data) }
    }

    fn submit(&mut self, req: GenerateRequest) {
        self.b.apply(Command::Submit(vec![req]), &mut self.waiting, &mut self.running);
    }

    fn abort(&mut self, id: u64) {
        self.b.apply(Command::Abort(id), &mut self.waiting, &mut self.running);
    }

    /// One iteration of the model loop, then the block manager's invariants.
    fn tick(&mut self) {
        self.b.admit(&mut self.waiting, &mut self.running, &mut self.order);
        assert!(self.running.len() <= self.b.sched.max_running, "more running than --max-running-requests");
        if !self.running.is_empty() {
            self.b.step(&mut self.running, &mut self.waiting, &mut self.order, Default::default());
        }
        let blocks = &self.b.sched.blocks;
        blocks.check().unwrap_or_else(|e| panic!("block manager: {e}"));
        let held: usize =
            self.running.iter().filter_map(|s| s.kv).map(|id| blocks.block_table(id).unwrap().len()).sum();
        assert!(blocks.num_used_blocks() <= blocks.num_blocks());
        assert!(
            held >= blocks.num_used_blocks(),
            "blocks in use ({}) that no running sequence holds ({held})",
            blocks.num_used_blocks()
        );
        assert!(self.waiting.iter().all(|s| s.kv.is_none()), "a waiting sequence holds blocks");
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    fn events(&self) -> Vec<OutputEvent> {
        self.b.outbox.drain(CLIENT)
    }

    /// Ticks until idle (at most `max_steps`), collecting events per request.
    fn run(&mut self, max_steps: usize, log: &mut HashMap<u64, Vec<OutputEvent>>) {
        for _ in 0..max_steps {
            if self.idle() {
                return;
            }
            self.tick();
            for e in self.events() {
                log.entry(e.request_id).or_default().push(e);
            }
        }
        panic!("not idle after {max_steps} steps");
    }
}

fn request(id: u64, prompt_ids: Vec<u64>, params: SamplingParams) -> GenerateRequest {
    GenerateRequest { id, client: CLIENT, prompt_ids, items: Vec::new(), cache_instance: 0, params, sibling_of: None }
}

fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams { max_tokens, temperature: 0.0, ..Default::default() }
}

fn random_prompt(rng: &mut Rng, len: usize) -> Vec<u64> {
    // Ids 3.. avoid the fixture's special tokens.
    (0..len).map(|_| 3 + rng.next_u64() % 1000).collect()
}

/// Every request ends exactly once, with no event after its end; returns the finishes.
fn finishes(log: &HashMap<u64, Vec<OutputEvent>>) -> HashMap<u64, FinishReason> {
    let mut out = HashMap::new();
    for (id, events) in log {
        let ends: Vec<usize> = (0..events.len()).filter(|&i| events[i].finish.is_some()).collect();
        assert_eq!(ends.len(), 1, "request {id} ended {} times", ends.len());
        assert_eq!(ends[0], events.len() - 1, "request {id} has events after its end");
        out.insert(*id, events[ends[0]].finish.clone().expect("end"));
    }
    out
}

#[test]
fn randomised_scheduling_loses_nothing_and_frees_every_block() {
    let (mut preemptions, mut forks) = (0, 0);
    for seed in 0..6u64 {
        let mut rng = Rng::new(seed);
        // A pool of 24 blocks of 4 tokens: far less than the load, so admission waits,
        // estimates overshoot and preemption happens.
        let mut h = Harness::new(Setup {
            num_blocks: 24,
            block_size: 4,
            chunk: 1 + (rng.next_u64() % 24) as usize,
            max_running: 2 + (rng.next_u64() % 8) as usize,
            expected_output: (seed % 2 == 0).then_some(2),
        });
        let mut log: HashMap<u64, Vec<OutputEvent>> = HashMap::new();
        let mut submitted: Vec<(u64, u32)> = Vec::new();
        let mut aborted = Vec::new();
        let mut next_id = 1u64;
        for _round in 0..40 {
            // Submit a few, abort one now and then (waiting, running or a parked sibling).
            for _ in 0..rng.next_u64() % 3 {
                let len = 1 + (rng.next_u64() % 40) as usize;
                let max_tokens = 1 + (rng.next_u64() % 24) as u32;
                let params = SamplingParams {
                    max_tokens,
                    temperature: if rng.next_u64().is_multiple_of(2) { 0.0 } else { 0.9 },
                    seed: Some(rng.next_u64()),
                    ignore_eos: rng.next_u64().is_multiple_of(2),
                    ..Default::default()
                };
                let prompt = random_prompt(&mut rng, len);
                let choices = 1 + u64::from(rng.next_u64().is_multiple_of(4)) * 2;
                let leader = next_id;
                for c in 0..choices {
                    let mut req = request(next_id, prompt.clone(), params.clone());
                    req.sibling_of = (c > 0).then_some(leader);
                    submitted.push((next_id, max_tokens));
                    h.submit(req);
                    next_id += 1;
                }
            }
            if rng.next_u64().is_multiple_of(4) && next_id > 1 {
                let id = 1 + rng.next_u64() % (next_id - 1);
                aborted.push(id);
                h.abort(id);
            }
            for _ in 0..1 + rng.next_u64() % 4 {
                if !h.idle() {
                    h.tick();
                }
            }
            for e in h.events() {
                log.entry(e.request_id).or_default().push(e);
            }
        }
        h.run(20_000, &mut log);
        let ends = finishes(&log);
        assert_eq!(ends.len(), submitted.len(), "seed {seed}: requests lost");
        for &(id, max_tokens) in &submitted {
            let tokens = log[&id].iter().filter(|e| e.token_id.is_some()).count();
            assert!(tokens <= max_tokens as usize, "seed {seed}: request {id} made {tokens} > {max_tokens} tokens");
            match &ends[&id] {
                FinishReason::Length => assert_eq!(tokens, max_tokens as usize, "seed {seed}: request {id}"),
                FinishReason::Abort => assert!(aborted.contains(&id), "seed {seed}: {id} aborted unasked"),
                FinishReason::Stop => {}
                other => panic!("seed {seed}: request {id} ended with {other:?}"),
            }
        }
        let blocks = &h.b.sched.blocks;
        assert_eq!(blocks.num_used_blocks(), 0, "seed {seed}: blocks still held");
        assert_eq!(blocks.num_seqs(), 0, "seed {seed}: sequences still registered");
        preemptions += h.b.counts.preemptions.load(Ordering::Relaxed);
        forks += h.b.counts.forks.load(Ordering::Relaxed);
    }
    assert!(preemptions > 0, "the pool was never exhausted: the test does not exercise preemption");
    assert!(forks > 0, "no sibling choice forked: the test does not exercise sharing");
}

/// Top log-probabilities of each step of a greedy run with `logprobs = 20`.
fn logprob_rows(h: &mut Harness, id: u64, prompt: &[u64]) -> Vec<Vec<(u32, f32)>> {
    let params = SamplingParams { logprobs: Some(20), ignore_eos: true, ..greedy(6) };
    h.submit(request(id, prompt.to_vec(), params));
    let mut log = HashMap::new();
    h.run(1000, &mut log);
    log.remove(&id).unwrap_or_default().into_iter().filter_map(|e| e.logprobs.map(|l| l.top)).collect()
}

#[test]
fn a_prefix_cache_hit_gives_the_same_logits() {
    let mut rng = Rng::new(42);
    let prompt = random_prompt(&mut rng, 45);
    let mut h = Harness::new(Setup { num_blocks: 64, block_size: 8, chunk: 16, max_running: 4, expected_output: None });
    let cold = logprob_rows(&mut h, 1, &prompt);
    let hits_before = h.b.sched.blocks.stats().hit_tokens;
    let warm = logprob_rows(&mut h, 2, &prompt);
    assert_eq!(h.b.sched.blocks.stats().hit_tokens - hits_before, 40, "the second run should reuse 5 full blocks");
    assert_eq!(cold.len(), 6);
    assert_eq!(cold.len(), warm.len());
    for (step, (a, b)) in cold.iter().zip(&warm).enumerate() {
        assert_eq!(a.len(), 20);
        for ((ta, la), (tb, lb)) in a.iter().zip(b) {
            assert_eq!(ta, tb, "step {step}: token order differs");
            assert!((la - lb).abs() <= 1e-4, "step {step}: logprob {la} vs {lb}");
        }
    }
}

#[test]
fn sibling_choices_prefill_the_prompt_once() {
    let mut rng = Rng::new(7);
    let prompt = random_prompt(&mut rng, 30);
    let mut h = Harness::new(Setup { num_blocks: 64, block_size: 8, chunk: 64, max_running: 8, expected_output: None });
    let params = SamplingParams { max_tokens: 5, ignore_eos: true, temperature: 0.9, ..Default::default() };
    for i in 0..4u64 {
        let mut req = request(10 + i, prompt.clone(), SamplingParams { seed: Some(i), ..params.clone() });
        req.sibling_of = (i > 0).then_some(10);
        h.submit(req);
    }
    let mut log = HashMap::new();
    h.run(100, &mut log);
    let counts = &h.b.counts;
    assert_eq!(counts.prefill_tokens.load(Ordering::Relaxed), 30, "the prompt is computed once for 4 choices");
    assert_eq!(counts.forks.load(Ordering::Relaxed), 3);
    let ends = finishes(&log);
    assert!((10..14).all(|id| ends[&id] == FinishReason::Length));
    // Each choice's tokens are those of the same seed run alone.
    for i in 0..4u64 {
        let mut alone =
            Harness::new(Setup { num_blocks: 64, block_size: 8, chunk: 64, max_running: 8, expected_output: None });
        alone.submit(request(1, prompt.clone(), SamplingParams { seed: Some(i), ..params.clone() }));
        let mut solo = HashMap::new();
        alone.run(100, &mut solo);
        let ids = |events: &[OutputEvent]| events.iter().filter_map(|e| e.token_id).collect::<Vec<_>>();
        assert_eq!(ids(&log[&(10 + i)]), ids(&solo[&1]), "choice {i}");
    }
    // A sibling arriving after its leader started decoding runs on its own, reusing the
    // prompt's full blocks through the prefix cache.
    let hits = h.b.sched.blocks.stats().hit_tokens;
    h.submit(request(20, prompt.clone(), params.clone()));
    h.tick();
    h.tick();
    let mut late = request(21, prompt.clone(), params.clone());
    late.sibling_of = Some(20);
    h.submit(late);
    h.run(100, &mut log);
    assert_eq!(h.b.counts.forks.load(Ordering::Relaxed), 3);
    assert!(h.b.sched.blocks.stats().hit_tokens - hits >= 24 * 2);
    assert_eq!(h.b.sched.blocks.num_used_blocks(), 0);
}

#[test]
fn aborting_a_leader_lets_its_parked_siblings_run() {
    let prompt = random_prompt(&mut Rng::new(3), 20);
    let mut h = Harness::new(Setup { num_blocks: 64, block_size: 8, chunk: 4, max_running: 8, expected_output: None });
    for i in 0..3u64 {
        let mut req = request(30 + i, prompt.clone(), greedy(3));
        req.sibling_of = (i > 0).then_some(30);
        h.submit(req);
    }
    h.tick(); // the leader's first chunk; its siblings wait parked in it
    assert_eq!(h.running.len(), 1);
    assert_eq!(h.running[0].followers.len(), 2);
    h.abort(30);
    let mut log = HashMap::new();
    h.run(100, &mut log);
    let ends = finishes(&log);
    assert_eq!(ends[&30], FinishReason::Abort);
    assert_ne!(ends[&31], FinishReason::Abort);
    assert_ne!(ends[&32], FinishReason::Abort);
    assert_eq!(h.b.sched.blocks.num_used_blocks(), 0);
}

#[test]
fn admission_estimates_output_from_recent_requests_when_not_busy() {
    let mut h =
        Harness::new(Setup { num_blocks: 40, block_size: 4, chunk: 64, max_running: 16, expected_output: None });
    assert_eq!(h.b.expected_output(), None, "no history yet: the full max_tokens");
    for len in [3u64, 4, 5, 5, 6, 6, 6, 7, 8, 20] {
        h.b.sched.lengths.record(len);
    }
    assert_eq!(h.b.expected_output(), Some(8));
    // Prompts of 8 with max_tokens 64: alone each needs 72 + 3 slots, the pool holds 160;
    // with the estimate of 8 several fit at once.
    for id in 0..6u64 {
        h.submit(request(100 + id, random_prompt(&mut Rng::new(id), 8), greedy(64)));
    }
    h.tick();
    assert!(h.running.len() >= 4, "estimate not used: {} admitted", h.running.len());
    // Busy (most blocks in use): the estimate is off.
    let mut held = Vec::new();
    while (h.b.sched.blocks.num_used_blocks() as f64) < 0.85 * 40.0 {
        let (id, _) = h.b.sched.blocks.new_seq(&[]);
        h.b.sched.blocks.allocate(id, 4).expect("room");
        held.push(id);
    }
    assert_eq!(h.b.expected_output(), None);
    for id in held {
        h.b.sched.blocks.free(id).expect("free");
    }
}

#[test]
fn a_seeded_request_samples_the_same_alone_or_among_others() {
    let setup = || Setup { num_blocks: 128, block_size: 4, chunk: 16, max_running: 16, expected_output: None };
    let prompt = random_prompt(&mut Rng::new(5), 23);
    let params = SamplingParams {
        max_tokens: 12,
        temperature: 1.1,
        top_p: 0.9,
        top_k: 50,
        seed: Some(1234),
        ignore_eos: true,
        ..Default::default()
    };
    let ids = |events: &[OutputEvent]| events.iter().filter_map(|e| e.token_id).collect::<Vec<_>>();
    let mut alone = Harness::new(setup());
    alone.submit(request(1, prompt.clone(), params.clone()));
    let mut log = HashMap::new();
    alone.run(200, &mut log);
    let want = ids(&log[&1]);
    // Among 15 unseeded, differently sized others, submitted before and after it.
    let mut crowd = Harness::new(setup());
    let mut rng = Rng::new(9);
    for id in 100..108 {
        let len = 1 + (rng.next_u64() % 40) as usize;
        crowd.submit(request(id, random_prompt(&mut rng, len), SamplingParams { max_tokens: 9, ..params.clone() }));
    }
    crowd.submit(request(1, prompt, params.clone()));
    for id in 108..115 {
        let len = 1 + (rng.next_u64() % 40) as usize;
        crowd.submit(request(id, random_prompt(&mut rng, len), SamplingParams { seed: None, ..params.clone() }));
    }
    let mut log = HashMap::new();
    crowd.run(500, &mut log);
    assert_eq!(ids(&log[&1]), want);
    assert_eq!(want.len(), 12);
}

#[test]
fn device_picks_send_ids_host_picks_whole_rows() {
    use super::Pick;
    use crate::sampler::Next;
    let rows = [[0.0f32, 3.0, 1.0, 3.0], [5.0, -1.0, 0.0, 2.0], [-2.0, -1.0, -3.0, -0.5], [0.0, 0.0, 9.0, 0.0]];
    let logits = candle_core::Tensor::new(&rows, &Device::Cpu).unwrap();
    let draw = mmserve_models::SampleSettings { temperature: 1.0, top_k: 1, min_p: 0.0, top_p: 1.0, u: 0.5 };
    let next = super::next_tokens(&logits, &[Pick::Argmax, Pick::Host, Pick::Argmax, Pick::Draw(draw)]).unwrap();
    assert!(matches!(next[0], Next::Greedy(1)), "first of tied maxima, as torch.argmax: {:?}", next[0]);
    assert!(matches!(&next[1], Next::Logits(r) if r == &rows[1]), "{:?}", next[1]);
    assert!(matches!(next[2], Next::Greedy(3)), "{:?}", next[2]);
    assert!(matches!(next[3], Next::Sampled(2)), "top-1 of its own row: {:?}", next[3]);
    let all = super::next_tokens(&logits, &[Pick::Host, Pick::Host, Pick::Host, Pick::Host]).unwrap();
    assert!(all.iter().zip(&rows).all(|(n, r)| matches!(n, Next::Logits(l) if l == r)));
}
