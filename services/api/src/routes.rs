//! HTTP routes: chat completions (streamed or not), health, models, metrics.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Method, StatusCode, Uri};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use futures::StreamExt;
use mmserve_protocol::{FinishReason, OutputEvent, deadline};
use tokio::sync::mpsc;

use crate::access::{AccessLog, RequestIds};
use crate::error::ApiError;
use crate::generate::{Started, start};
use crate::metrics::{self as m, ChoiceMeter};
use crate::openai::*;
use crate::state::AppState;
use crate::tools::{self, Piece};
use axum::Extension;
use metrics::counter;

/// Who may call what: API keys (on `/v1/*`, and `/metrics` when protected) and the
/// origins browser pages may call from.
pub struct Access {
    pub keys: crate::auth::ApiKeys,
    pub protect_metrics: bool,
    pub cors: Option<tower_http::cors::CorsLayer>,
}

/// The CORS layer for `--allowed-origins` (`*`: any origin); `None` for none.
pub fn cors(origins: &[String]) -> Result<Option<tower_http::cors::CorsLayer>, String> {
    use axum::http::{HeaderName, HeaderValue, header};
    use tower_http::cors::{AllowOrigin, CorsLayer};
    let origins: Vec<&str> = origins.iter().map(|o| o.trim()).filter(|o| !o.is_empty()).collect();
    if origins.is_empty() {
        return Ok(None);
    }
    let allow = if origins.contains(&"*") {
        AllowOrigin::any()
    } else {
        let list = origins
            .iter()
            .map(|o| HeaderValue::from_str(o).map_err(|_| format!("{o:?} is not a valid origin")))
            .collect::<Result<Vec<_>, _>>()?;
        AllowOrigin::list(list)
    };
    let request_id = HeaderName::from_static("x-request-id");
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE, request_id.clone()])
            .expose_headers([request_id])
            .max_age(std::time::Duration::from_secs(600)),
    ))
}

pub fn router(state: Arc<AppState>, max_body_bytes: usize, access: Access) -> Router {
    let chat = move |State(state): State<Arc<AppState>>, Extension(ids): Extension<RequestIds>, body: Body| {
        generate(state, ids, body, max_body_bytes, Kind::Chat)
    };
    let completions = move |State(state): State<Arc<AppState>>, Extension(ids): Extension<RequestIds>, body: Body| {
        generate(state, ids, body, max_body_bytes, Kind::Completion)
    };
    let keyed = axum::middleware::from_fn_with_state(access.keys, crate::auth::require_key);
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat).fallback(method_not_allowed))
        .route("/v1/completions", post(completions).fallback(method_not_allowed))
        .route("/v1/models", get(models).fallback(method_not_allowed))
        .route("/v1/models/{id}", get(model).fallback(method_not_allowed))
        .route("/tokenize", post(crate::tokens::tokenize).fallback(method_not_allowed))
        .route("/detokenize", post(crate::tokens::detokenize).fallback(method_not_allowed))
        .route_layer(keyed.clone());
    let metrics = Router::new().route("/metrics", get(metrics).fallback(method_not_allowed));
    let metrics = if access.protect_metrics { metrics.route_layer(keyed) } else { metrics };
    let app = Router::new()
        .merge(v1)
        .merge(metrics)
        .route("/health", get(health).fallback(method_not_allowed))
        .route("/version", get(version).fallback(method_not_allowed))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), crate::access::request_id))
        .with_state(state);
    // Outermost: preflights are answered before any key or route is looked at.
    match access.cors {
        Some(cors) => app.layer(cors),
        None => app,
    }
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::RouteNotFound { method: method.to_string(), path: uri.path().to_string() }
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed { method: method.to_string(), path: uri.path().to_string() }
}

/// The body, at most `limit` bytes (413 beyond), within the body timeout (408).
async fn read_body(state: &AppState, body: Body, limit: usize) -> Result<Bytes, ApiError> {
    let read = async {
        let mut chunks = body.into_data_stream();
        let mut buf = bytes::BytesMut::new();
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| ApiError::bad(format!("reading the request body: {e}")))?;
            if buf.len() + chunk.len() > limit {
                return Err(ApiError::PayloadTooLarge(format!(
                    "the request body is larger than the limit of {limit} bytes (--max-body-bytes)"
                )));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf.freeze())
    };
    tokio::time::timeout(state.timeouts.body, read).await.map_err(|_| {
        ApiError::Timeout(format!(
            "the request body did not arrive within {} s (--body-read-timeout-s)",
            state.timeouts.body.as_secs()
        ))
    })?
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn finish_name(r: &FinishReason) -> &'static str {
    m::reason_label(r)
}

async fn generate(state: Arc<AppState>, ids: RequestIds, body: Body, max_body_bytes: usize, kind: Kind) -> Response {
    let arrived = Instant::now();
    counter!(m::REQUESTS).increment(1);
    let mut log = AccessLog::new(&ids, &state.model_name, arrived);
    let result = generate_inner(&state, &ids, body, max_body_bytes, kind, &mut log).await;
    result.unwrap_or_else(|e| {
        counter!(m::FAILED).increment(1);
        if matches!(e, ApiError::Overloaded { .. }) {
            counter!(m::SHED).increment(1);
        }
        log.status = e.status().as_u16();
        log.finish = Some("error");
        e.into_response()
    })
}

async fn generate_inner(
    state: &Arc<AppState>,
    ids: &RequestIds,
    body: Body,
    max_body_bytes: usize,
    kind: Kind,
    log: &mut AccessLog,
) -> Result<Response, ApiError> {
    let arrived = log.arrived();
    // The body first (bounded by its timeout and size, and the connection cap), so that
    // clients sending slowly hold a connection, not a place in the queue; then shed load
    // before any work for the request.
    let body = read_body(state, body, max_body_bytes).await?;
    let queued = state.load.enter()?;
    let req: ChatRequest = match kind {
        Kind::Chat => {
            serde_json::from_slice(&body).map_err(|e| ApiError::bad(format!("invalid chat completion request: {e}")))?
        }
        Kind::Completion => ChatRequest::from_completion(
            serde_json::from_slice(&body).map_err(|e| ApiError::bad(format!("invalid completion request: {e}")))?,
        )?,
    };
    drop(body);
    match req.unsupported() {
        Err(field) => return Err(ApiError::bad_param(field, format!("`{field}` is not supported by this server"))),
        Ok(unknown) if !unknown.is_empty() => tracing::warn!(fields = ?unknown, "ignoring unknown request fields"),
        Ok(_) => {}
    }
    let started = start(state, &req, queued, &ids.request).await?;
    counter!(m::PROMPT_TOKENS_TOTAL).increment(started.prompt_ids.len() as u64);
    log.prompt_tokens = started.prompt_ids.len() as u64;
    (log.image_tokens, log.audio_tokens) = (started.image_tokens, started.audio_tokens);
    (log.embed_hits, log.embed_misses) = started.embed_hits_misses;
    let id = ids.completion.clone();
    let meters =
        (0..started.choices.len()).map(|_| ChoiceMeter::new(arrived, started.prompt_ids.len() as u64)).collect();
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let log = log.hand_on();
        Ok(stream(state.clone(), started, meters, log, kind, id, include_usage, req.return_token_ids).into_response())
    } else {
        let c = collect(state, started, meters, log, id, req.return_token_ids).await?;
        Ok(match kind {
            Kind::Chat => axum::Json(c).into_response(),
            Kind::Completion => axum::Json(text_completion(c)).into_response(),
        })
    }
}

/// Waits for the next event of one choice, at most the token timeout.
async fn next_event(
    state: &AppState,
    events: &mut mpsc::UnboundedReceiver<OutputEvent>,
) -> Result<OutputEvent, ApiError> {
    match tokio::time::timeout(state.timeouts.token, events.recv()).await {
        Ok(Some(ev)) => Ok(ev),
        Ok(None) => Err(ApiError::Internal("the request's event stream closed".into())),
        Err(_) => {
            Err(ApiError::Unavailable(format!("no token from the engine within {} s", state.timeouts.token.as_secs())))
        }
    }
}

/// `cached`: the first choice's prompt tokens from the prefix cache (siblings fork its
/// prompt).
fn usage(started: &Started, completion: u64, cached: u64) -> Usage {
    let prompt = started.prompt_ids.len() as u64;
    Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: prompt + completion,
        prompt_tokens_details: PromptDetails {
            cached_tokens: cached,
            image_tokens: started.image_tokens,
            audio_tokens: started.audio_tokens,
        },
    }
}

/// A finish the client sees as an error, or `None` for a normal end.
fn finish_error(finish: &FinishReason) -> Option<ApiError> {
    match finish {
        FinishReason::Error(message) => Some(ApiError::Internal(format!("generation failed: {message}"))),
        FinishReason::Retry(message) => Some(ApiError::Unavailable(message.clone())),
        _ => None,
    }
}

/// OpenAI's logprob entry of one token.
fn token_logprob(state: &AppState, token: u32, lp: &mmserve_protocol::TokenLogprobs) -> TokenLogprob {
    let text = |t: u32| state.tokenizer.decode(&[t], false);
    let piece = text(token);
    TokenLogprob {
        bytes: piece.as_bytes().to_vec(),
        token: piece,
        logprob: lp.logprob,
        top_logprobs: lp
            .top
            .iter()
            .map(|&(t, logprob)| {
                let token = text(t);
                TopLogprob { bytes: token.as_bytes().to_vec(), token, logprob }
            })
            .collect(),
    }
}

async fn collect(
    state: &AppState,
    mut started: Started,
    mut meters: Vec<ChoiceMeter>,
    log: &mut AccessLog,
    id: String,
    return_ids: bool,
) -> Result<ChatCompletion, ApiError> {
    let mut choices = Vec::with_capacity(started.choices.len());
    let (mut completion, mut cached) = (0u64, 0u64);
    let mut streams = std::mem::take(&mut started.choices);
    for (index, ((request_id, events), meter)) in streams.iter_mut().zip(&mut meters).enumerate() {
        let (mut text, mut tokens, mut logprobs) = (String::new(), Vec::new(), None::<Logprobs>);
        let finish = loop {
            let ev = next_event(state, events).await?;
            started.guard.first_token();
            if let (Some(t), Some(lp)) = (ev.token_id, &ev.logprobs) {
                logprobs.get_or_insert_with(Logprobs::default).content.push(token_logprob(state, t, lp));
            }
            if ev.token_id.is_some() {
                meter.token();
                log.token();
            }
            tokens.extend(ev.token_id);
            text.push_str(&ev.text);
            if let Some(f) = ev.finish {
                meter.end(&f, ev.timing.as_ref());
                if index == 0 {
                    cached = ev.timing.map_or(0, |t| t.cached_tokens);
                    (log.cached_tokens, log.finish) = (cached, Some(finish_name(&f)));
                }
                break f;
            }
        };
        // On an error the guard aborts on drop: harmless if the engine already dropped
        // the request, needed if the failure came from this side (the event poll failed).
        if let Some(e) = finish_error(&finish) {
            return Err(e);
        }
        started.guard.mark_finished(*request_id);
        completion += tokens.len() as u64;
        let mut reader = started.tools.as_ref().map(|t| t.reader(call_ids(&id, index)));
        let message = match reader.as_mut() {
            None => AssistantMessage { role: "assistant", content: Some(text), tool_calls: None },
            Some(r) => {
                let (content, calls) = tools::gather(tools::read(Some(r), text, true));
                AssistantMessage { role: "assistant", content, tool_calls: (!calls.is_empty()).then_some(calls) }
            }
        };
        let reason = finish_name(&finish);
        choices.push(Choice {
            index: index as u32,
            message,
            finish_reason: Some(reader.map_or(reason, |r| r.finish_reason(reason))),
            logprobs,
            token_ids: return_ids.then_some(tokens),
        });
    }
    Ok(ChatCompletion {
        id,
        object: "chat.completion",
        created: now(),
        model: state.model_name.clone(),
        choices,
        usage: usage(&started, completion, cached),
        prompt_token_ids: return_ids.then(|| started.prompt_ids.clone()),
    })
}

/// The ids of a choice's tool calls, before their index.
fn call_ids(completion_id: &str, choice: usize) -> String {
    let unique = completion_id.rsplit('-').next().unwrap_or(completion_id);
    format!("call_{unique}_{choice}_")
}

/// A chunk's delta for a piece of output.
fn delta(piece: Piece) -> Delta {
    match piece {
        Piece::Content(text) => Delta { content: Some(text), ..Delta::default() },
        Piece::Call(call) => Delta { tool_calls: Some(vec![call]), ..Delta::default() },
    }
}

/// What the SSE stream carries between frames.
struct StreamState {
    state: Arc<AppState>,
    started: Started,
    /// Every choice's events, merged: (choice index, event).
    events: futures::stream::SelectAll<futures::stream::BoxStream<'static, (usize, OutputEvent)>>,
    /// The engine request id of each choice.
    choice_ids: Vec<u64>,
    /// Each choice's metrics (dropped with the stream: an unfinished one is an abort).
    meters: Vec<ChoiceMeter>,
    /// The first choice's prompt tokens from the prefix cache, once it ends.
    cached: u64,
    /// Written when the stream ends, however it ends.
    log: AccessLog,
    kind: Kind,
    /// Characters of each choice's text so far (completions' logprob offsets).
    offsets: Vec<usize>,
    /// Each choice's reader of tool calls (with tools).
    readers: Vec<Option<tools::Reader>>,
    /// Choices not finished yet.
    open: usize,
    id: String,
    created: u64,
    completion: u64,
    include_usage: bool,
    return_ids: bool,
    /// Frames built but not yet sent, oldest first.
    pending: std::collections::VecDeque<Event>,
    done: bool,
}

/// Which OpenAI endpoint a request came through: the same generation, two shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    /// `/v1/completions`: a raw prompt, `text_completion` objects.
    Completion,
}

impl StreamState {
    fn chunk(&mut self, index: usize, delta: Delta, finish: Option<&'static str>, extra: ChunkExtra) -> Event {
        let c = ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.state.model_name.clone(),
            choices: vec![ChunkChoice {
                index: index as u32,
                delta,
                finish_reason: finish,
                logprobs: extra.logprobs,
                token_ids: extra.token_ids,
            }],
            usage: None,
        };
        self.frame(index, c)
    }

    /// The SSE frame of a chunk, in the endpoint's shape.
    fn frame(&mut self, index: usize, c: ChatChunk) -> Event {
        let data = match self.kind {
            Kind::Chat => serde_json::to_string(&c),
            Kind::Completion => {
                let offset = self.offsets.get(index).copied().unwrap_or(0);
                let added: usize =
                    c.choices.iter().filter_map(|ch| ch.delta.content.as_ref()).map(|t| t.chars().count()).sum();
                if let Some(o) = self.offsets.get_mut(index) {
                    *o += added;
                }
                serde_json::to_string(&text_completion_chunk(c, offset))
            }
        };
        Event::default().data(data.unwrap_or_default())
    }
}

#[derive(Default)]
struct ChunkExtra {
    logprobs: Option<Logprobs>,
    token_ids: Option<Vec<u32>>,
}

/// The SSE response of a started request (the parts of a [`StreamState`]).
#[allow(clippy::too_many_arguments)]
fn stream(
    state: Arc<AppState>,
    mut started: Started,
    meters: Vec<ChoiceMeter>,
    log: AccessLog,
    kind: Kind,
    id: String,
    include_usage: bool,
    return_ids: bool,
) -> impl IntoResponse {
    let receivers = std::mem::take(&mut started.choices);
    let keep_alive = state.timeouts.sse_keep_alive;
    let mut events = futures::stream::SelectAll::new();
    let mut ids = Vec::with_capacity(receivers.len());
    for (index, (request_id, rx)) in receivers.into_iter().enumerate() {
        ids.push(request_id);
        let s = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|ev| (ev, rx)) });
        events.push(s.map(move |ev| (index, ev)).boxed());
    }
    let open = ids.len();
    let s_tools = started.tools.clone();
    let mut s = StreamState {
        state,
        started,
        events,
        choice_ids: ids,
        meters,
        cached: 0,
        log,
        kind,
        offsets: vec![0; open],
        readers: (0..open).map(|i| s_tools.as_ref().map(|t| t.reader(call_ids(&id, i)))).collect(),
        open,
        id,
        created: now(),
        completion: 0,
        include_usage,
        return_ids,
        pending: Default::default(),
        done: false,
    };
    for index in (0..open).filter(|_| kind == Kind::Chat) {
        let first = s.chunk(
            index,
            Delta { role: Some("assistant"), content: Some(String::new()), tool_calls: None },
            None,
            ChunkExtra::default(),
        );
        s.pending.push_back(first);
    }
    // The guard lives inside the stream: if the client disconnects, the stream is
    // dropped and the request is aborted and its cache references released.
    let body = futures::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(ev) = s.pending.pop_front() {
                return Some((Ok::<_, Infallible>(ev), s));
            }
            if s.done {
                return None;
            }
            let next = tokio::time::timeout(s.state.timeouts.token, s.events.next()).await;
            match next {
                Ok(Some((index, ev))) => s.on_event(index, ev),
                Ok(None) => {
                    let e = ApiError::Internal("the request's event stream closed".into());
                    s.pending.push_back(Event::default().data(e.body_for(Some(&s.log.id)).to_string()));
                    s.log.finish = Some("error");
                    s.done = true;
                }
                Err(_) => {
                    let e = ApiError::Unavailable(format!(
                        "no token from the engine within {} s",
                        s.state.timeouts.token.as_secs()
                    ));
                    s.pending.push_back(Event::default().data(e.body_for(Some(&s.log.id)).to_string()));
                    s.log.finish = Some("error");
                    s.done = true;
                }
            }
        }
    });
    Sse::new(body).keep_alive(axum::response::sse::KeepAlive::new().interval(keep_alive))
}

impl StreamState {
    fn on_event(&mut self, index: usize, ev: OutputEvent) {
        self.started.guard.first_token();
        if ev.token_id.is_some() {
            self.completion += 1;
            if let Some(m) = self.meters.get_mut(index) {
                m.token();
            }
            self.log.token();
        }
        let extra = ChunkExtra {
            logprobs: match (ev.token_id, &ev.logprobs) {
                (Some(t), Some(lp)) => Some(Logprobs { content: vec![token_logprob(&self.state, t, lp)] }),
                _ => None,
            },
            token_ids: self.return_ids.then(|| ev.token_id.into_iter().collect()),
        };
        let Some(reason) = ev.finish else {
            // (an event without a finish: the meter saw its token above)
            let pieces = tools::read(self.readers.get_mut(index).and_then(Option::as_mut), ev.text, false);
            let mut extra = Some(extra);
            for p in pieces {
                let frame = self.chunk(index, delta(p), None, extra.take().unwrap_or_default());
                self.pending.push_back(frame);
            }
            if let Some(extra) = extra.filter(|e| e.logprobs.is_some() || self.return_ids) {
                let frame = self.chunk(index, Delta { content: Some(String::new()), ..Delta::default() }, None, extra);
                self.pending.push_back(frame);
            }
            return;
        };
        if let Some(m) = self.meters.get_mut(index) {
            m.end(&reason, ev.timing.as_ref());
        }
        if index == 0 {
            self.cached = ev.timing.map_or(0, |t| t.cached_tokens);
            (self.log.cached_tokens, self.log.finish) = (self.cached, Some(finish_name(&reason)));
        }
        if let Some(err) = finish_error(&reason) {
            // The guard aborts every choice when the stream ends.
            self.pending.push_back(Event::default().data(err.body_for(Some(&self.log.id)).to_string()));
            self.log.finish = Some("error");
            self.done = true;
            return;
        }
        if let Some(&request_id) = self.choice_ids.get(index) {
            self.started.guard.mark_finished(request_id);
        }
        let mut reader = self.readers.get_mut(index).and_then(Option::take);
        let mut pieces = tools::read(reader.as_mut(), ev.text, true);
        // The last piece goes with the finish; each piece before it is a chunk.
        let last = pieces.pop().map_or_else(Delta::default, delta);
        let mut extra = Some(extra);
        for p in pieces {
            let frame = self.chunk(index, delta(p), None, extra.take().unwrap_or_default());
            self.pending.push_back(frame);
        }
        let reason = finish_name(&reason);
        let reason = reader.map_or(reason, |r| r.finish_reason(reason));
        let last = self.chunk(index, last, Some(reason), extra.unwrap_or_default());
        self.pending.push_back(last);
        self.open -= 1;
        if self.open > 0 {
            return;
        }
        if self.include_usage {
            let c = ChatChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.state.model_name.clone(),
                choices: Vec::new(),
                usage: Some(usage(&self.started, self.completion, self.cached)),
            };
            let frame = self.frame(0, c);
            self.pending.push_back(frame);
        }
        self.pending.push_back(Event::default().data("[DONE]"));
        self.done = true;
    }
}

/// The served model as OpenAI's model object, under `name`.
fn model_object(state: &AppState, name: &str) -> serde_json::Value {
    serde_json::json!({
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "mmserve",
        "max_model_len": state.max_model_len,
    })
}

async fn models(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let names = std::iter::once(&state.model_name).chain(&state.aliases);
    axum::Json(
        serde_json::json!({"object": "list", "data": names.map(|n| model_object(&state, n)).collect::<Vec<_>>()}),
    )
}

async fn model(State(state): State<Arc<AppState>>, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    if state.serves(&id) {
        axum::Json(model_object(&state, &id)).into_response()
    } else {
        ApiError::ModelNotFound(id).into_response()
    }
}

async fn version() -> impl IntoResponse {
    axum::Json(serde_json::json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// Ready only when every service answers.
async fn health(State(state): State<Arc<AppState>>) -> Response {
    let t = state.timeouts.health;
    let (c, e, g) = tokio::join!(
        state.cache.call(|c| async move { c.stats(deadline(t)).await }),
        state.encoder.stats(deadline(t)),
        state.engine.info(deadline(t))
    );
    let mut down = Vec::new();
    if c.is_err() {
        down.push("embed-cache");
    }
    if e.is_err() {
        down.push("encoder");
    }
    if g.is_err() {
        down.push("engine");
    }
    if down.is_empty() {
        (StatusCode::OK, axum::Json(serde_json::json!({"status": "ok"}))).into_response()
    } else {
        ApiError::Unavailable(format!("not ready: {} not answering", down.join(", "))).into_response()
    }
}

/// Prometheus text format: the other services' figures as of now, then the recorder's
/// rendering (see [`crate::metrics`] and `docs/metrics.md`).
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let t = state.timeouts.health;
    let (c, e, g) = tokio::join!(
        state.cache.call(|c| async move { c.stats(deadline(t)).await }),
        state.encoder.stats(deadline(t)),
        state.engine.info(deadline(t))
    );
    m::refresh(c.as_ref().ok(), e.as_ref().ok(), g.as_ref().ok(), state.load.queued());
    ([("content-type", "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}
