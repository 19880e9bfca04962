//! Load shedding. A request counts as queued from the moment its body has arrived until
//! its first token (while its media are fetched, while it waits for cache room, for the
//! encoder, in the engine's queue). Beyond `--max-queued-requests` queued requests, or
//! `--max-queued-prompt-tokens` of their prompts, a new request is answered 429 with
//! `Retry-After` before any work is done for it, so a burst costs the server bounded
//! work and the clients a fast answer instead of minutes in line.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::error::ApiError;

/// What a client is told to wait before retrying.
const RETRY_AFTER_S: u64 = 1;

pub struct LoadGate {
    max_requests: usize,
    max_tokens: u64,
    requests: AtomicUsize,
    tokens: AtomicU64,
}

impl LoadGate {
    pub fn new(max_requests: usize, max_tokens: u64) -> Arc<Self> {
        Arc::new(LoadGate { max_requests, max_tokens, requests: AtomicUsize::new(0), tokens: AtomicU64::new(0) })
    }

    /// Queues a request, or refuses it (429) when the line is full.
    pub fn enter(self: &Arc<Self>) -> Result<Queued, ApiError> {
        let taken = self
            .requests
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.max_requests).then_some(n + 1));
        if taken.is_err() {
            return Err(overloaded(format!(
                "the server has {} requests waiting for their first token (--max-queued-requests); retry later",
                self.max_requests
            )));
        }
        Ok(Queued { gate: self.clone(), tokens: 0, queued: true })
    }

    /// Requests queued now, and their prompt tokens.
    pub fn queued(&self) -> (usize, u64) {
        (self.requests.load(Ordering::Acquire), self.tokens.load(Ordering::Acquire))
    }
}

fn overloaded(message: String) -> ApiError {
    ApiError::Overloaded { message, retry_after_s: RETRY_AFTER_S }
}

/// A request's place in the line; dropping it (or [`Queued::leave`]) gives it back.
pub struct Queued {
    gate: Arc<LoadGate>,
    tokens: u64,
    queued: bool,
}

impl Queued {
    /// Counts the request's prompt tokens, or refuses it (429) if the queued prompts
    /// would exceed the limit. A prompt larger than the limit alone is let through when
    /// nothing else is queued, so that no request is refused forever.
    pub fn add_prompt_tokens(&mut self, n: u64) -> Result<(), ApiError> {
        let gate = &self.gate;
        let taken = gate.tokens.fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
            (t == 0 || t.saturating_add(n) <= gate.max_tokens).then_some(t.saturating_add(n))
        });
        if taken.is_err() {
            return Err(overloaded(format!(
                "the queued requests' prompts exceed {} tokens (--max-queued-prompt-tokens); retry later",
                gate.max_tokens
            )));
        }
        self.tokens += n;
        Ok(())
    }

    /// The first token came: the request no longer waits.
    pub fn leave(&mut self) {
        if std::mem::take(&mut self.queued) {
            self.gate.requests.fetch_sub(1, Ordering::AcqRel);
            self.gate.tokens.fetch_sub(std::mem::take(&mut self.tokens), Ordering::AcqRel);
        }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_tokens_are_bounded_and_given_back() {
        let gate = LoadGate::new(2, 100);
        let mut a = gate.enter().unwrap();
        a.add_prompt_tokens(500).unwrap(); // alone in line: let through
        let mut b = gate.enter().unwrap();
        assert!(matches!(b.add_prompt_tokens(1), Err(ApiError::Overloaded { .. })));
        assert!(matches!(gate.enter(), Err(ApiError::Overloaded { .. })));
        a.leave();
        a.leave(); // once only
        assert_eq!(gate.queued(), (1, 0));
        b.add_prompt_tokens(60).unwrap();
        let mut c = gate.enter().unwrap();
        assert!(c.add_prompt_tokens(41).is_err());
        c.add_prompt_tokens(40).unwrap();
        drop((b, c));
        assert_eq!(gate.queued(), (0, 0));
    }
}
