//! Request ids and the access log.
//!
//! Every response carries `x-request-id`: the client's own (if it sent a usable one),
//! else the chat completion's id. The id names the `request` span around the handler, so
//! every log line about the request carries it; it goes to the engine and the encoder
//! with the request's RPCs, and into error bodies (`error.request_id`). One access-log
//! line (target `mmserve::access`, level info) ends each chat request: its id, status,
//! model, token counts, embed-cache hits, time to first token, latency, finish reason and
//! client address.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

use crate::state::AppState;

/// The peer of the connection a request came on (set by [`crate::http`]).
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub SocketAddr);

/// A request's ids, an extension from [`request_id`] on.
#[derive(Debug, Clone)]
pub struct RequestIds {
    /// What `x-request-id` says and logs show.
    pub request: String,
    /// The chat completion's `id` (`chatcmpl-…`); the request id too unless the client
    /// sent one.
    pub completion: String,
    pub client: Option<SocketAddr>,
}

tokio::task_local! {
    /// The request id while its handler runs, for error bodies built anywhere in it.
    static CURRENT: String;
}

/// The id of the request whose handler is running, if any.
pub fn current() -> Option<String> {
    CURRENT.try_with(Clone::clone).ok()
}

/// The longest client id taken; longer ones, or ones with characters outside visible
/// ASCII, are replaced (they would go into headers and logs).
const MAX_ID_LEN: usize = 128;

fn usable(v: &HeaderValue) -> Option<String> {
    let s = v.to_str().ok()?;
    (!s.is_empty() && s.len() <= MAX_ID_LEN && s.bytes().all(|b| b.is_ascii_graphic())).then(|| s.to_string())
}

/// Middleware: gives the request its ids, runs it in their span and scope, and sets
/// `x-request-id` on the response.
pub async fn request_id(State(state): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    let prefix = if req.uri().path() == "/v1/completions" { "cmpl" } else { "chatcmpl" };
    let completion = format!("{prefix}-{:x}", state.new_request_id());
    let request = req.headers().get("x-request-id").and_then(usable).unwrap_or_else(|| completion.clone());
    let client = req.extensions().get::<ClientAddr>().map(|c| c.0);
    req.extensions_mut().insert(RequestIds { request: request.clone(), completion, client });
    let span = tracing::info_span!("request", id = %request);
    let mut response = CURRENT.scope(request.clone(), next.run(req).instrument(span)).await;
    if let Ok(v) = HeaderValue::from_str(&request) {
        response.headers_mut().insert("x-request-id", v);
    }
    response
}

/// The access-log line of one chat request, written when it is dropped: at the end of
/// the handler, or of the stream it handed its body to.
#[derive(Clone)]
pub struct AccessLog {
    pub id: String,
    pub client: Option<SocketAddr>,
    pub model: String,
    arrived: Instant,
    pub status: u16,
    pub prompt_tokens: u64,
    pub image_tokens: u64,
    pub audio_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    pub embed_hits: u64,
    pub embed_misses: u64,
    pub first_token: Option<Instant>,
    /// The first choice's finish reason (or `error`).
    pub finish: Option<&'static str>,
    /// Handed on: another value writes the line.
    moved: bool,
}

impl AccessLog {
    pub fn new(ids: &RequestIds, model: &str, arrived: Instant) -> Self {
        AccessLog {
            id: ids.request.clone(),
            client: ids.client,
            model: model.to_string(),
            arrived,
            status: 200,
            prompt_tokens: 0,
            image_tokens: 0,
            audio_tokens: 0,
            completion_tokens: 0,
            cached_tokens: 0,
            embed_hits: 0,
            embed_misses: 0,
            first_token: None,
            finish: None,
            moved: false,
        }
    }

    /// This line, to be written by whoever holds the result (a stream); `self` writes none.
    pub fn hand_on(&mut self) -> AccessLog {
        let taken = self.clone();
        self.moved = true;
        taken
    }

    pub fn arrived(&self) -> Instant {
        self.arrived
    }

    pub fn token(&mut self) {
        self.completion_tokens += 1;
        self.first_token.get_or_insert_with(Instant::now);
    }
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        if self.moved {
            return;
        }
        let ms = |t: Instant| (t - self.arrived).as_secs_f64() * 1e3;
        tracing::info!(
            target: "mmserve::access",
            id = %self.id,
            status = self.status,
            model = %self.model,
            prompt_tokens = self.prompt_tokens,
            image_tokens = self.image_tokens,
            audio_tokens = self.audio_tokens,
            completion_tokens = self.completion_tokens,
            cached_tokens = self.cached_tokens,
            embed_hits = self.embed_hits,
            embed_misses = self.embed_misses,
            ttft_ms = self.first_token.map(ms),
            latency_ms = ms(Instant::now()),
            finish_reason = self.finish.unwrap_or("none"),
            client = %self.client.map_or_else(|| "-".to_string(), |c| c.to_string()),
            "request"
        );
    }
}
