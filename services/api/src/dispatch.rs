//! Routes the engine's events to the request that waits for them. One task long-polls
//! the engine for this api process's events (woken by the engine's notification, so a
//! token is forwarded as soon as it exists).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use mmserve_protocol::{EngineClient, FinishReason, OutputEvent, deadline};
use tokio::sync::mpsc;

#[derive(Default)]
pub struct Dispatcher {
    routes: Mutex<HashMap<u64, mpsc::UnboundedSender<OutputEvent>>>,
    /// Set when the api shuts down: the engine going away then is expected, not an error.
    closing: std::sync::atomic::AtomicBool,
}

impl Dispatcher {
    /// The api is shutting down: a failed poll from now on ends polling quietly.
    pub fn close(&self) {
        self.closing.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Call before submitting, so no event can arrive unrouted.
    pub fn register(&self, request_id: u64) -> mpsc::UnboundedReceiver<OutputEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.lock().insert(request_id, tx);
        rx
    }

    pub fn unregister(&self, request_id: u64) {
        self.lock().remove(&request_id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, mpsc::UnboundedSender<OutputEvent>>> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn route(&self, events: Vec<OutputEvent>) {
        let mut routes = self.lock();
        for ev in events {
            let done = ev.finish.is_some();
            if let Some(tx) = routes.get(&ev.request_id) {
                let _ = tx.send(ev.clone());
            }
            if done {
                routes.remove(&ev.request_id);
            }
        }
    }

    /// Fails every request in flight (the engine stopped answering).
    fn fail_all(&self, reason: &str) {
        for (id, tx) in self.lock().drain() {
            let _ = tx.send(OutputEvent {
                request_id: id,
                token_id: None,
                logprobs: None,
                text: String::new(),
                finish: Some(FinishReason::Retry(reason.to_string())),
                timing: None,
            });
        }
    }

    /// Polls forever, each long poll waiting at most `poll` on the engine side (and
    /// `poll + rpc` in all). When the engine fails, the requests in flight fail and
    /// polling resumes after a pause (the supervisor stops everything if the engine is gone).
    pub async fn run(&self, engine: EngineClient, client: u64, poll: Duration, rpc: Duration) {
        loop {
            match engine.next_events(deadline(poll + rpc), client, poll.as_millis() as u64).await {
                Ok(events) => self.route(events),
                Err(_) if self.closing.load(std::sync::atomic::Ordering::Acquire) => {
                    self.fail_all("the server is shutting down");
                    return;
                }
                Err(e) => {
                    tracing::error!("engine event poll failed: {e}");
                    self.fail_all(&format!("the engine did not answer: {e}"));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }
}
