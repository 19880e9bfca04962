//! The output processor: a chosen token becomes an event for the api. Detokenizes
//! incrementally, matches stop ids, `max_tokens` and stop strings, and pushes the event
//! into the [`Outbox`] of the request's api process.

use std::sync::Arc;

use mmserve_protocol::{FinishReason, GenerateRequest, OutputEvent, RequestTiming, TokenLogprobs};
use mmserve_text::{IncrementalDecoder, TextTokenizer};

use crate::outbox::Outbox;
use crate::stops::StopMatcher;

/// One sequence's detokenizing state.
pub struct Detok {
    decoder: IncrementalDecoder,
    stops: StopMatcher,
}

impl Detok {
    pub fn new(req: &GenerateRequest) -> Self {
        Detok {
            decoder: IncrementalDecoder::new(req.params.skip_special_tokens),
            stops: StopMatcher::new(&req.params.stop),
        }
    }
}

/// A chosen token and what comes with it.
pub struct Step {
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
    /// Output tokens so far, this one included.
    pub generated: usize,
    /// The token is one of the request's stop ids.
    pub stop_token: bool,
    /// The request's time in the engine so far (sent if this token ends it).
    pub timing: RequestTiming,
}

pub struct OutputProcessor {
    pub tokenizer: TextTokenizer,
    pub outbox: Arc<Outbox>,
}

impl OutputProcessor {
    /// Publishes `step`'s token, the `generated`-th output token of `req`. Returns whether
    /// the request finished.
    pub fn token(&self, req: &GenerateRequest, detok: &mut Detok, step: Step) -> bool {
        let Step { token, logprobs, generated, stop_token, timing } = step;
        let mut finish = if stop_token {
            Some(FinishReason::Stop)
        } else if generated >= req.params.max_tokens as usize {
            Some(FinishReason::Length)
        } else {
            None
        };
        let decoded = detok.decoder.push(&self.tokenizer, token);
        let matched = detok.stops.push(&decoded);
        let mut text = matched.text;
        if matched.stopped {
            finish = Some(FinishReason::Stop);
        } else if finish.is_some() {
            // The decoder's held-back tail, then the stop matcher's.
            let tail = detok.decoder.finish(&self.tokenizer);
            let tail = detok.stops.push(&tail);
            text.push_str(&tail.text);
            if tail.stopped {
                finish = Some(FinishReason::Stop);
            } else {
                text.push_str(&detok.stops.finish());
            }
        }
        let done = finish.is_some();
        let timing = done.then_some(timing);
        let event = OutputEvent { request_id: req.id, token_id: Some(token), logprobs, text, finish, timing };
        self.outbox.push(req.client, [event]);
        done
    }

    /// Ends `req` without a token.
    pub fn finish(&self, req: &GenerateRequest, reason: FinishReason) {
        if let FinishReason::Error(why) | FinishReason::Retry(why) = &reason {
            tracing::warn!(request_id = %req.request_id, engine_id = req.id, "request ended: {why}");
        }
        let event = OutputEvent {
            request_id: req.id,
            token_id: None,
            logprobs: None,
            text: String::new(),
            finish: Some(reason),
            timing: None,
        };
        self.outbox.push(req.client, [event]);
    }
}
