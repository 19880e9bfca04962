//! The model loop driven step by step with the tiny fixture LM: its wiring under random
//! load (the scheduler's own randomised tests run without a model, in
//! `scheduler/tests.rs`), prefix-cache invariance of the logits, prompt sharing between
//! choices, and seeded sampling that does not depend on the batch.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device};
use mmserve_arena::ArenaView;
use mmserve_config::ModelDir;
use mmserve_models::{Llama, PagedKv, Placement};
use mmserve_protocol::{ArenaDtype, ArenaInfo, FinishReason, GenerateRequest, OutputEvent, SamplingParams};
use mmserve_shm::Segment;
use mmserve_text::TextTokenizer;

use super::{Command, ModelLoop};
use crate::kv::BlockManager;
use crate::outbox::Outbox;
use crate::output::OutputProcessor;
use crate::runner::LlamaRunner;
use crate::sampler::Rng;
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::service::Counts;

const CLIENT: u64 = 7;

fn model_dir() -> ModelDir {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/models/llava-tiny");
    ModelDir::open(&dir).expect("fixture model")
}

/// A model thread without its thread: the test calls `tick` for each step.
struct Harness {
    l: ModelLoop<LlamaRunner>,
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
        let sched = Scheduler::new(
            BlockManager::new(s.num_blocks, s.block_size).expect("blocks"),
            SchedulerConfig {
                max_running: s.max_running,
                chunked_prefill_size: s.chunk,
                expected_output: s.expected_output,
            },
        );
        let l = ModelLoop {
            runner: LlamaRunner {
                model,
                kv,
                arena: crate::inputs::ModelArena::new(Arc::new(arena), &Device::Cpu).expect("arena"),
            },
            sched,
            output: OutputProcessor { tokenizer, outbox: Arc::new(Outbox::default()) },
            counts: Arc::new(Counts::default()),
            masks: crate::masks::MaskPool::new(),
        };
        Harness { l, _arenas: (embed, data) }
    }

    fn submit(&mut self, req: GenerateRequest) {
        self.l.apply(Command::Submit(vec![(req, None)]));
    }

    fn abort(&mut self, id: u64) {
        self.l.apply(Command::Abort(id));
    }

    /// One iteration of the model loop, then the block manager's invariants.
    fn tick(&mut self) {
        self.l.step();
        self.l.sched.blocks().check().unwrap_or_else(|e| panic!("block manager: {e}"));
    }

    fn idle(&self) -> bool {
        self.l.sched.is_idle()
    }

    fn events(&self) -> Vec<OutputEvent> {
        self.l.output.outbox.drain(CLIENT)
    }

    fn stats(&self) -> crate::scheduler::SchedStats {
        self.l.sched.stats()
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
    GenerateRequest {
        request_id: String::new(),
        id,
        client: CLIENT,
        prompt_ids,
        items: Vec::new(),
        cache_instance: 0,
        params,
        sibling_of: None,
        positions: None,
    }
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
fn random_load_through_the_model_loses_nothing_and_frees_every_block() {
    let (mut preemptions, mut forks) = (0, 0);
    for seed in 0..3u64 {
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
        let blocks = h.l.sched.blocks();
        assert_eq!(blocks.num_used_blocks(), 0, "seed {seed}: blocks still held");
        assert_eq!(blocks.num_seqs(), 0, "seed {seed}: sequences still registered");
        preemptions += h.stats().preemptions;
        forks += h.stats().forks;
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
    let hits_before = h.l.sched.blocks().stats().hit_tokens;
    let warm = logprob_rows(&mut h, 2, &prompt);
    assert_eq!(h.l.sched.blocks().stats().hit_tokens - hits_before, 40, "the second run should reuse 5 full blocks");
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
    let prefilled = h.l.counts.prefill_tokens.load(Ordering::Relaxed);
    assert_eq!(prefilled, 30, "the prompt is computed once for 4 choices");
    assert_eq!(h.stats().forks, 3);
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
    let hits = h.l.sched.blocks().stats().hit_tokens;
    h.submit(request(20, prompt.clone(), params.clone()));
    h.tick();
    h.tick();
    let mut late = request(21, prompt.clone(), params.clone());
    late.sibling_of = Some(20);
    h.submit(late);
    h.run(100, &mut log);
    assert_eq!(h.stats().forks, 3);
    assert!(h.l.sched.blocks().stats().hit_tokens - hits >= 24 * 2);
    assert_eq!(h.l.sched.blocks().num_used_blocks(), 0);
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

/// A constrained sequence decodes the same whether its mask is made on the mask pool and
/// applied where the logits are (the device pick) or applied by the host sampler (asking
/// for logprobs keeps the row on the host), alone, preempted in a crowd, or as one of
/// sibling choices; its text always matches, and unconstrained neighbours are unchanged.
#[test]
fn constrained_sequences_decode_alike_on_every_path() {
    use mmserve_protocol::Constraint;
    let dir = model_dir();
    let eos = TextTokenizer::from_dir(&dir).expect("tokenizer").eos_ids()[0];
    let grammars = mmserve_grammar::Grammars::new(&dir, eos).expect("grammars");
    let regex = Constraint::Regex("[a-z]{2,6}( [a-z]{2,6}){2,4}\\.".into());
    let matches = |text: &str| {
        let words: Vec<&str> = text.strip_suffix('.').unwrap_or("!").split(' ').collect();
        (3..=5).contains(&words.len())
            && words.iter().all(|w| (2..=6).contains(&w.len()) && w.chars().all(|c| c.is_ascii_lowercase()))
    };
    let prompt = random_prompt(&mut Rng::new(11), 17);
    let params = |seed: u64, host: bool, temperature: f32| SamplingParams {
        max_tokens: 48,
        temperature,
        seed: Some(seed),
        logprobs: host.then_some(1),
        constraint: Some(regex.clone()),
        ..Default::default()
    };
    let setup = |num_blocks| Setup { num_blocks, block_size: 4, chunk: 16, max_running: 16, expected_output: Some(2) };
    let ids = |events: &[OutputEvent]| events.iter().filter_map(|e| e.token_id).collect::<Vec<_>>();
    let text = |events: &[OutputEvent]| events.iter().map(|e| e.text.as_str()).collect::<String>();
    let submit = |h: &mut Harness, req: GenerateRequest| {
        let m = grammars.matcher(req.params.constraint.as_ref().expect("constrained")).expect("matcher");
        h.l.apply(Command::Submit(vec![(req, Some(m))]));
    };
    let mut alone = Vec::new();
    for (seed, temperature) in [(0, 0.0), (1, 1.0), (2, 1.0), (3, 0.8)] {
        let mut runs = Vec::new();
        for host in [false, true] {
            let mut h = Harness::new(setup(128));
            submit(&mut h, request(1, prompt.clone(), params(seed, host, temperature)));
            let mut log = HashMap::new();
            h.run(200, &mut log);
            assert_eq!(finishes(&log)[&1], FinishReason::Stop, "seed {seed}: {}", text(&log[&1]));
            assert!(matches(&text(&log[&1])), "seed {seed} host {host}: {:?}", text(&log[&1]));
            runs.push(ids(&log[&1]));
        }
        assert_eq!(runs[0], runs[1], "seed {seed}: the device and the host paths differ");
        alone.push(runs.remove(0));
    }
    // In a crowd too small for all (preemption), beside unconstrained requests, and the
    // sampled ones also as sibling choices of one request.
    let plain = SamplingParams { max_tokens: 10, temperature: 0.0, ignore_eos: true, ..Default::default() };
    let mut solo = Harness::new(setup(128));
    solo.submit(request(50, random_prompt(&mut Rng::new(3), 9), plain.clone()));
    let mut log = HashMap::new();
    solo.run(200, &mut log);
    let plain_alone = ids(&log[&50]);
    let mut crowd = Harness::new(setup(20));
    crowd.submit(request(50, random_prompt(&mut Rng::new(3), 9), plain));
    for (k, (seed, temperature)) in [(0, 0.0), (1, 1.0), (2, 1.0), (3, 0.8)].into_iter().enumerate() {
        submit(&mut crowd, request(10 + k as u64, prompt.clone(), params(seed, k % 2 == 1, temperature)));
    }
    for (k, seed) in [1u64, 2].into_iter().enumerate() {
        let mut req = request(30 + k as u64, prompt.clone(), params(seed, false, 1.0));
        req.sibling_of = (k > 0).then_some(30);
        submit(&mut crowd, req);
    }
    let mut log = HashMap::new();
    crowd.run(2000, &mut log);
    assert!(crowd.stats().preemptions > 0, "the crowd was meant to preempt");
    for k in 0..4 {
        assert_eq!(ids(&log[&(10 + k as u64)]), alone[k], "request {k} in the crowd");
    }
    assert_eq!(ids(&log[&30]), alone[1]);
    assert_eq!(ids(&log[&31]), alone[2]);
    assert_eq!(ids(&log[&50]), plain_alone, "the unconstrained neighbour");
    assert_eq!(crowd.l.sched.blocks().num_used_blocks(), 0);
    // Twelve at once: a step's constraints follow their tokens side by side on the pool.
    let mut wide = Harness::new(setup(512));
    for copy in 0..3u64 {
        for (k, (seed, temperature)) in [(0, 0.0), (1, 1.0), (2, 1.0), (3, 0.8)].into_iter().enumerate() {
            submit(
                &mut wide,
                request(100 + 10 * copy + k as u64, prompt.clone(), params(seed, k % 2 == 1, temperature)),
            );
        }
    }
    let mut log = HashMap::new();
    wide.run(2000, &mut log);
    for copy in 0..3u64 {
        for (k, want) in alone.iter().enumerate() {
            assert_eq!(&ids(&log[&(100 + 10 * copy + k as u64)]), want, "copy {copy} of request {k}");
        }
    }
}

/// A device pick of a constrained sequence stands only under a mask that allows
/// something: without a mask (making it failed) or under an empty one, the sequence ends
/// with its stop id rather than emit a token the grammar never allowed.
#[test]
fn a_device_pick_without_a_usable_mask_ends_the_constrained_sequence() {
    use crate::sampler::{Next, SamplingState};
    let dir = model_dir();
    let eos = TextTokenizer::from_dir(&dir).expect("tokenizer").eos_ids()[0];
    let grammars = mmserve_grammar::Grammars::new(&dir, eos).expect("grammars");
    let constraint = mmserve_protocol::Constraint::Regex("[a-z]{3}".into());
    let params = SamplingParams { max_tokens: 8, constraint: Some(constraint.clone()), ..Default::default() };
    let state = || {
        let m = grammars.matcher(&constraint).expect("matcher");
        SamplingState::new(&request(1, vec![5, 6], params.clone()), 1024, &[eos]).with_grammar(Some(m))
    };
    let mask = state().grammar.as_mut().expect("grammar").mask().expect("mask");
    let allowed = (0..1024u32).find(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1).expect("something allowed");
    let mut s = state();
    assert_eq!(s.choose_unadvanced(&params, Next::Greedy(allowed), Some(&mask)).0, allowed);
    assert!(!s.constraint_done);
    for m in [None, Some(vec![0u32; mask.len()])] {
        let mut s = state();
        assert_eq!(s.choose_unadvanced(&params, Next::Greedy(allowed), m.as_deref()).0, eos, "mask {:?}", m.is_some());
        assert!(s.constraint_done);
    }
}
