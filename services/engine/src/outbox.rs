//! Events waiting to be collected, per api process, with a notification so that a
//! long poll wakes as soon as the model thread pushes.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use mmserve_protocol::OutputEvent;
use tokio::sync::Notify;

#[derive(Default)]
pub struct Outbox {
    queues: Mutex<HashMap<u64, VecDeque<OutputEvent>>>,
    notify: Notify,
}

impl Outbox {
    pub fn push(&self, client: u64, events: impl IntoIterator<Item = OutputEvent>) {
        let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        queues.entry(client).or_default().extend(events);
        drop(queues);
        self.notify.notify_waiters();
    }

    /// Everything queued for `client` now.
    pub fn drain(&self, client: u64) -> Vec<OutputEvent> {
        let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        queues.get_mut(&client).map(|q| q.drain(..).collect()).unwrap_or_default()
    }

    /// Everything queued for `client`, waiting up to `max_wait` for the first event.
    pub async fn take(&self, client: u64, max_wait: Duration) -> Vec<OutputEvent> {
        let deadline = tokio::time::Instant::now() + max_wait;
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let events = self.drain(client);
            if !events.is_empty() {
                return events;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Vec::new();
            }
        }
    }
}
