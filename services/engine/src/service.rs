//! The tarpc face of the engine.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{DType, Device};
use mmserve_config::ModelDir;
use mmserve_embed_cache::ArenaView;
use mmserve_models::Llama;
use mmserve_protocol::reconnect::CacheConnection;
use mmserve_protocol::{ArenaInfo, Engine, EngineError, EngineInfo, GenerateRequest, OutputEvent, deadline};
use mmserve_text::TextTokenizer;
use tarpc::context::Context;

use crate::batch::{Batcher, Command};
use crate::inputs::validate;
use crate::outbox::Outbox;
use crate::{EngineArgs, EngineServiceError};

/// Queue sizes, published by the model thread for `info`.
#[derive(Default)]
pub struct Counts {
    running: AtomicU64,
    waiting: AtomicU64,
}

impl Counts {
    pub fn set(&self, running: usize, waiting: usize) {
        self.running.store(running as u64, Ordering::Relaxed);
        self.waiting.store(waiting as u64, Ordering::Relaxed);
    }
}

/// The longest a long poll may hold, whatever the caller asks (below tarpc's deadline).
const MAX_POLL: Duration = Duration::from_secs(5);

#[derive(Clone)]
pub struct EngineService {
    commands: Arc<Mutex<Option<SyncSender<Command>>>>,
    outbox: Arc<Outbox>,
    counts: Arc<Counts>,
    vocab: usize,
    max_len: usize,
    /// The arenas the model thread reads (or will read once its `Remap` arrives).
    arena: Arc<Mutex<ArenaInfo>>,
    cache: Arc<CacheConnection>,
}

impl EngineService {
    pub fn start(args: &EngineArgs, info: ArenaInfo, cache: CacheConnection) -> Result<Self, EngineServiceError> {
        let dir = ModelDir::open(&args.model)?;
        let model = Llama::load(&dir, &Device::Cpu, DType::F32)?;
        let tokenizer = TextTokenizer::from_dir(&dir)?;
        let view = ArenaView::open(&info)?;
        let vocab = model.config().vocab_size;
        let max_len = model.config().max_position_embeddings;
        let outbox = Arc::new(Outbox::default());
        let counts = Arc::new(Counts::default());
        // Bounded: a flood of submissions waits here instead of growing without limit.
        let (tx, rx) = std::sync::mpsc::sync_channel(1024);
        let batcher = Batcher {
            model,
            tokenizer,
            arena: view,
            outbox: outbox.clone(),
            max_running: args.max_running_requests.max(1),
            counts: counts.clone(),
        };
        std::thread::Builder::new()
            .name("engine-model".into())
            .spawn(move || batcher.run(rx))
            .expect("spawning the model thread");
        Ok(EngineService {
            commands: Arc::new(Mutex::new(Some(tx))),
            outbox,
            counts,
            vocab,
            max_len,
            arena: Arc::new(Mutex::new(info)),
            cache: Arc::new(cache),
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

    /// The arenas of `instance`, mapping them first if the cache restarted since.
    async fn arena_for(&self, instance: u64) -> Result<ArenaInfo, EngineError> {
        let current = self.arena.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if current.instance == instance {
            return Ok(current);
        }
        let info = self
            .cache
            .call(|c| async move { c.arena(deadline(Duration::from_secs(5))).await })
            .await
            .map_err(|e| EngineError::Invalid(e.to_string()))?;
        if info.instance != instance {
            return Err(EngineError::Invalid(
                "the embed cache restarted while the request was in flight; retry it".into(),
            ));
        }
        let view = ArenaView::open(&info).map_err(|e| EngineError::Invalid(e.to_string()))?;
        self.send(Command::Remap(Box::new(view)))?;
        *self.arena.lock().unwrap_or_else(|p| p.into_inner()) = info.clone();
        Ok(info)
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
        }
    }

    async fn submit(self, _: Context, request: GenerateRequest) -> Result<(), EngineError> {
        // A text-only request reads no arena.
        let slots = match request.items.is_empty() {
            true => 0,
            false => self.arena_for(request.cache_instance).await?.slots,
        };
        validate(&request, self.vocab, slots, self.max_len)?;
        self.send(Command::Submit(Box::new(request)))
    }

    async fn abort(self, _: Context, request_id: u64) {
        let _ = self.send(Command::Abort(request_id));
    }

    async fn next_events(self, _: Context, client: u64, max_wait_ms: u64) -> Vec<OutputEvent> {
        self.outbox.take(client, Duration::from_millis(max_wait_ms).min(MAX_POLL)).await
    }
}
