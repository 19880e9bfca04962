//! The tarpc face of the engine.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mmserve_arena::{ArenaMap, ArenaView, Mapped};
use mmserve_config::ModelDir;
use mmserve_models::{Llama, PagedKv};
use mmserve_protocol::reconnect::CacheConnection;
use mmserve_protocol::{ArenaInfo, Engine, EngineError, EngineInfo, GenerateRequest, OutputEvent};
use mmserve_text::TextTokenizer;
use tarpc::context::Context;

use crate::inputs::validate;
use crate::model_loop::{Command, ModelLoop};
use crate::outbox::Outbox;
use crate::output::OutputProcessor;
use crate::runner::LlamaRunner;
use crate::scheduler::{SchedStats, Scheduler, SchedulerConfig};
use crate::{EngineArgs, EngineServiceError};

/// Queue sizes, published by the model thread for `info`.
#[derive(Default)]
pub struct Counts {
    pub(crate) running: AtomicU64,
    pub(crate) waiting: AtomicU64,
    pub(crate) prefix_hit_tokens: AtomicU64,
    pub(crate) preemptions: AtomicU64,
    pub(crate) blocks_used: AtomicU64,
    pub(crate) blocks_total: AtomicU64,
    pub(crate) prefill_tokens: AtomicU64,
    pub(crate) forks: AtomicU64,
    pub(crate) steps: AtomicU64,
    pub(crate) schedule_ns: AtomicU64,
    pub(crate) step_ns: AtomicU64,
}

impl Counts {
    pub fn set(&self, running: usize, waiting: usize) {
        self.running.store(running as u64, Ordering::Relaxed);
        self.waiting.store(waiting as u64, Ordering::Relaxed);
    }

    pub fn set_kv(&self, prefix_hit_tokens: u64, blocks_used: usize, blocks_total: usize) {
        self.prefix_hit_tokens.store(prefix_hit_tokens, Ordering::Relaxed);
        self.blocks_used.store(blocks_used as u64, Ordering::Relaxed);
        self.blocks_total.store(blocks_total as u64, Ordering::Relaxed);
    }

    pub fn set_sched(&self, stats: SchedStats) {
        self.preemptions.store(stats.preemptions, Ordering::Relaxed);
        self.forks.store(stats.forks, Ordering::Relaxed);
    }

    /// One model step: `prefill` prompt tokens computed, time in the scheduler and in all.
    pub fn stepped(&self, prefill: usize, schedule: Duration, step: Duration) {
        self.prefill_tokens.fetch_add(prefill as u64, Ordering::Relaxed);
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.schedule_ns.fetch_add(schedule.as_nanos() as u64, Ordering::Relaxed);
        self.step_ns.fetch_add(step.as_nanos() as u64, Ordering::Relaxed);
    }
}

#[derive(Clone)]
pub struct EngineService {
    commands: Arc<Mutex<Option<SyncSender<Command>>>>,
    outbox: Arc<Outbox>,
    counts: Arc<Counts>,
    vocab: usize,
    max_len: usize,
    /// The model takes multimodal (M-RoPE) positions.
    mrope: bool,
    /// Token slots of the KV pool, and tokens per block: what one request may need.
    pool_tokens: usize,
    block_size: usize,
    /// The arenas the model thread reads (or will read once its `Remap` arrives).
    arena: Arc<ArenaMap>,
    cache: Arc<CacheConnection>,
    /// Longest wait to map the cache's arenas after it restarted.
    connect_timeout: Duration,
    /// Compiles requests' output constraints (cached) before they reach the model thread.
    grammars: Arc<mmserve_grammar::Grammars>,
}

impl EngineService {
    pub fn start(args: &EngineArgs, info: ArenaInfo, cache: CacheConnection) -> Result<Self, EngineServiceError> {
        let dir = ModelDir::open(&args.model)?;
        let placement = args.placement.resolve(&dir)?;
        let model = Llama::load(&dir, &placement)?;
        tracing::info!(device = ?placement.device, dtype = ?placement.dtype, format = %placement.format, "language model loaded");
        let tokenizer = TextTokenizer::from_dir(&dir)?;
        let eos = tokenizer.eos_ids().first().copied().unwrap_or_default();
        let grammars = Arc::new(mmserve_grammar::Grammars::new(&dir, eos)?);
        let view = Arc::new(ArenaView::open(&info)?);
        let vocab = model.config().vocab_size;
        let max_len = match args.max_model_len {
            None => model.config().max_position_embeddings,
            Some(n) if n > 0 && n <= model.config().max_position_embeddings => n,
            Some(asked) => {
                let model = model.config().max_position_embeddings;
                return Err(EngineServiceError::MaxModelLen { asked, model });
            }
        };
        let mrope = !model.config().mrope_section.is_empty();
        let cfg = model.config();
        let dtype = model.dtype();
        let kv = &args.kv;
        let num_blocks = crate::kv::blocks_for_budget(
            kv.kv_cache_memory.0,
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype.size_in_bytes(),
            kv.block_size,
        );
        let blocks = crate::kv::BlockManager::new(num_blocks, kv.block_size)
            .map_err(|e| EngineServiceError::Kv(e.to_string()))?
            .with_prefix_cache(!kv.no_prefix_cache);
        let paged = PagedKv::new(&model, num_blocks, kv.block_size, dtype)
            .map_err(|e| EngineServiceError::Kv(format!("{e} (raise --kv-cache-memory)")))?;
        let pool_tokens = blocks.pool_tokens();
        tracing::info!(num_blocks, block_size = kv.block_size, "paged KV cache");
        let outbox = Arc::new(Outbox::default());
        let counts = Arc::new(Counts::default());
        // Bounded: a flood of submissions waits here instead of growing without limit.
        let (tx, rx) = std::sync::mpsc::sync_channel(1024);
        let arena =
            crate::inputs::ModelArena::new(view.clone(), &placement.device).map_err(EngineServiceError::Cache)?;
        let sched = Scheduler::new(
            blocks,
            SchedulerConfig {
                max_running: args.max_running_requests,
                chunked_prefill_size: kv.chunked_prefill_size,
                expected_output: kv.expected_output_tokens,
            },
        );
        let model_loop = ModelLoop {
            runner: LlamaRunner { model, kv: paged, arena },
            sched,
            output: OutputProcessor { tokenizer, outbox: outbox.clone() },
            counts: counts.clone(),
            masks: crate::masks::MaskPool::new(),
        };
        mmserve_protocol::ready::spawn_vital("engine-model", move || model_loop.run(rx))
            .expect("spawning the model thread");
        Ok(EngineService {
            commands: Arc::new(Mutex::new(Some(tx))),
            outbox,
            counts,
            vocab,
            max_len,
            mrope,
            pool_tokens,
            block_size: args.kv.block_size,
            arena: Arc::new(ArenaMap::shared(view)),
            cache: Arc::new(cache),
            connect_timeout: Duration::from_secs(args.connect_timeout_s.max(1)),
            grammars,
        })
    }

    fn send(&self, cmd: Command) -> Result<(), EngineError> {
        let guard = self.commands.lock().unwrap_or_else(|p| p.into_inner());
        let tx = guard.as_ref().ok_or(EngineError::ShuttingDown)?;
        match tx.try_send(cmd) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(EngineError::Unavailable("the engine's queue is full; retry".into())),
            Err(TrySendError::Disconnected(_)) => Err(EngineError::ShuttingDown),
        }
    }

    /// The arenas of `instance`, mapping them first if the cache restarted since (the
    /// model thread registers them with its device before the next step).
    async fn arena_for(&self, instance: u64) -> Result<ArenaInfo, EngineError> {
        let mapped = self
            .arena
            .view(instance, &self.cache, self.connect_timeout)
            .await
            .map_err(|e| EngineError::Invalid(e.to_string()))?;
        if let Mapped::New(view) = &mapped {
            self.send(Command::Remap(view.clone()))?;
        }
        Ok(mapped.view().info.clone())
    }

    /// Closes the command channel; the model thread ends after its current step.
    pub fn stop(&self) {
        self.commands.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

impl Engine for EngineService {
    async fn info(self, _: Context) -> EngineInfo {
        EngineInfo {
            vocab_size: self.vocab as u64,
            max_model_len: self.max_len as u64,
            running: self.counts.running.load(Ordering::Relaxed),
            waiting: self.counts.waiting.load(Ordering::Relaxed),
            prefix_cache_hit_tokens: self.counts.prefix_hit_tokens.load(Ordering::Relaxed),
            preemptions: self.counts.preemptions.load(Ordering::Relaxed),
            kv_blocks_used: self.counts.blocks_used.load(Ordering::Relaxed),
            kv_blocks_total: self.counts.blocks_total.load(Ordering::Relaxed),
            kv_block_size: self.block_size as u64,
            prefill_tokens: self.counts.prefill_tokens.load(Ordering::Relaxed),
            forks: self.counts.forks.load(Ordering::Relaxed),
            steps: self.counts.steps.load(Ordering::Relaxed),
            schedule_seconds: self.counts.schedule_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            step_seconds: self.counts.step_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }

    async fn submit(self, _: Context, choices: Vec<GenerateRequest>) -> Result<(), EngineError> {
        if choices.is_empty() {
            return Err(EngineError::Invalid("no choices to run".into()));
        }
        for request in &choices {
            // A text-only request reads no arena.
            let slots = match request.items.is_empty() {
                true => 0,
                false => self.arena_for(request.cache_instance).await?.slots,
            };
            validate(request, self.vocab, slots, self.max_len, self.mrope)?;
            // Alone in the pool, with its last block partly empty: what can never fit is refused.
            let need =
                request.prompt_ids.len() as u64 + u64::from(request.params.max_tokens) + self.block_size as u64 - 1;
            if need > self.pool_tokens as u64 {
                return Err(EngineError::Invalid(format!(
                    "the prompt and max_tokens need {need} KV token slots; the pool (--kv-cache-memory) holds {}",
                    self.pool_tokens
                )));
            }
        }
        // Each constrained choice gets its matcher here, off the model thread (compiling a
        // new schema takes milliseconds; a repeated one is a copy from the cache).
        let mut submitted = Vec::with_capacity(choices.len());
        for request in choices {
            let grammar = match request.params.constraint.clone() {
                None => None,
                Some(c) => {
                    let grammars = self.grammars.clone();
                    let compiled = tokio::task::spawn_blocking(move || grammars.matcher(&c))
                        .await
                        .map_err(|e| EngineError::Invalid(format!("compiling the output constraint: {e}")))?;
                    Some(compiled.map_err(|e| EngineError::Invalid(e.to_string()))?)
                }
            };
            submitted.push((request, grammar));
        }
        self.send(Command::Submit(submitted))
    }

    async fn abort(self, _: Context, request_id: u64) {
        let _ = self.send(Command::Abort(request_id));
    }

    async fn next_events(self, _: Context, client: u64, max_wait_ms: u64) -> Vec<OutputEvent> {
        // The caller's deadline bounds the wait (tarpc cancels the handler when it passes).
        self.outbox.take(client, Duration::from_millis(max_wait_ms)).await
    }
}
