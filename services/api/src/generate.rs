//! One request's way through the services: check and key the media, reserve every
//! item at once in the embed cache, write new items' bytes to shared memory, have the
//! encoder fill the missing embeddings, submit to the engine. A [`RequestGuard`] owns
//! what the request holds and gives it back however the request ends.

use std::sync::Arc;

use mmserve_protocol::{
    AllocItem, EncodeItem, GenerateRequest, ItemRecord, ItemSpan, Modality, OutputEvent, RpcFailure, SamplingParams,
    deadline,
};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::media::{MediaItem, prepare_image};
use crate::openai::ChatRequest;
use crate::prompt::{expand, parse_messages, tokenize};
use crate::state::AppState;

/// Holds a request's cache references and its place in the engine. Dropping it (the
/// request finished, failed, or its client went away) aborts the engine request if it
/// is still running and releases every reference exactly once.
pub struct RequestGuard {
    state: Arc<AppState>,
    request_id: u64,
    cache_ids: Vec<u64>,
    submitted: bool,
    finished: bool,
}

impl RequestGuard {
    pub fn mark_finished(&mut self) {
        self.finished = true;
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.state.dispatcher.unregister(self.request_id);
        let abort = self.submitted && !self.finished;
        let ids = std::mem::take(&mut self.cache_ids);
        if !abort && ids.is_empty() {
            return;
        }
        let state = self.state.clone();
        let request_id = self.request_id;
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        rt.spawn(async move {
            let t = state.timeouts.rpc;
            if abort && let Err(e) = state.engine.abort(deadline(t), request_id).await {
                tracing::warn!("aborting request {request_id}: {e}");
            }
            if !ids.is_empty() {
                // If the cache restarted (or our connection broke), it dropped these
                // references itself when the connection closed.
                match state.cache.call(|c| async move { c.release(deadline(t), ids).await }).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::warn!("releasing cache items of {request_id}: {e}"),
                    Err(e) => tracing::warn!("releasing cache items of {request_id}: {e}"),
                }
            }
        });
    }
}

/// A request accepted by the engine.
pub struct Started {
    pub guard: RequestGuard,
    pub events: mpsc::UnboundedReceiver<OutputEvent>,
    pub prompt_ids: Vec<u64>,
    pub image_tokens: u64,
}

fn rpc<T>(service: &'static str, r: Result<T, tarpc::client::RpcError>) -> Result<T, ApiError> {
    r.map_err(|e| RpcFailure::new(service, e).into())
}

fn sampling(req: &ChatRequest, prompt_len: u64, max_model_len: u64) -> Result<SamplingParams, ApiError> {
    if req.n.unwrap_or(1) != 1 {
        return Err(ApiError::bad_param("n", "only n = 1 is supported"));
    }
    if req.stop.as_ref().is_some_and(|s| !s.is_null() && s != &serde_json::json!([])) {
        return Err(ApiError::bad_param("stop", "stop strings are not supported yet; use stop_token_ids"));
    }
    if req.logprobs == Some(true) {
        return Err(ApiError::bad_param("logprobs", "logprobs are not supported yet"));
    }
    let temperature = req.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad_param("temperature", "temperature must be between 0 and 2"));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad_param("top_p", "top_p must be in (0, 1]"));
    }
    let room = max_model_len.saturating_sub(prompt_len);
    let max_tokens = match req.max_completion_tokens.or(req.max_tokens) {
        Some(0) => return Err(ApiError::bad_param("max_tokens", "max_tokens must be at least 1")),
        Some(n) => u64::from(n),
        None => room,
    };
    if max_tokens == 0 || prompt_len + max_tokens > max_model_len {
        return Err(ApiError::bad_param(
            "max_tokens",
            format!(
                "this model's context is {max_model_len} tokens; the prompt has {prompt_len} and asks for {max_tokens} more"
            ),
        ));
    }
    Ok(SamplingParams {
        max_tokens: max_tokens as u32,
        temperature,
        top_p,
        seed: req.seed,
        ignore_eos: req.ignore_eos,
        stop_token_ids: req.stop_token_ids.clone(),
        skip_special_tokens: req.skip_special_tokens.unwrap_or(true),
    })
}

pub async fn start(state: &Arc<AppState>, req: &ChatRequest) -> Result<Started, ApiError> {
    if let Some(model) = &req.model
        && model != &state.model_name
    {
        return Err(ApiError::ModelNotFound(model.clone()));
    }
    let parsed = parse_messages(&req.messages)?;
    if parsed.image_urls.len() > state.limits.max_items {
        return Err(ApiError::bad_param(
            "messages",
            format!("{} images in one request; the limit is {}", parsed.image_urls.len(), state.limits.max_items),
        ));
    }
    let ids = tokenize(&state.template, &state.tokenizer, &parsed.template_messages)?;

    // Media: fetched, checked from the header and keyed, all items at once.
    let items: Vec<MediaItem> = futures::future::try_join_all(
        parsed
            .image_urls
            .iter()
            .map(|url| prepare_image(url, &state.limits, &state.fingerprint, state.tokens_per_image)),
    )
    .await?;
    let image_tokens: u64 = items.iter().map(|i| u64::from(i.token_num)).sum();
    let prompt_len = (ids.len() as u64).saturating_sub(items.len() as u64) + image_tokens;
    let params = sampling(req, prompt_len, state.max_model_len)?;

    let request_id = state.new_request_id();
    let mut guard =
        RequestGuard { state: state.clone(), request_id, cache_ids: Vec::new(), submitted: false, finished: false };
    let (cache_instance, records) = reserve(state, &items, &mut guard).await?;

    let ranges: Vec<(u64, u32)> = records.iter().map(|r| (r.token_id, r.token_num)).collect();
    let prompt_ids = expand(&ids, state.image_token, &ranges)?;
    let mut spans: Vec<ItemSpan> = Vec::new();
    for r in &records {
        if !spans.iter().any(|s| s.token_id == r.token_id) {
            spans.push(ItemSpan { token_id: r.token_id, token_num: r.token_num, start_index: r.start_index });
        }
    }

    let events = state.dispatcher.register(request_id);
    let request = GenerateRequest {
        id: request_id,
        client: state.client_id,
        prompt_ids: prompt_ids.clone(),
        items: spans,
        cache_instance,
        params,
    };
    // Marked before the call: if this handler is dropped after the engine accepted the
    // request, the guard still aborts it (aborting an unknown id is harmless).
    guard.submitted = true;
    rpc("engine", state.engine.submit(deadline(state.timeouts.rpc), request).await)??;
    Ok(Started { guard, events, prompt_ids, image_tokens })
}

/// Reserves every item at once, writes the bytes of items this request created, and
/// waits until every item's embedding is in the arena. Returns the cache instance and
/// the records.
async fn reserve(
    state: &AppState,
    items: &[MediaItem],
    guard: &mut RequestGuard,
) -> Result<(u64, Vec<ItemRecord>), ApiError> {
    if items.is_empty() {
        return Ok((0, Vec::new()));
    }
    let t = state.timeouts.rpc;
    let wait = state.timeouts.cache_wait;
    let alloc: Vec<AllocItem> = items
        .iter()
        .map(|i| AllocItem {
            digest: i.digest,
            modality: i.modality,
            token_num: i.token_num,
            data_len: i.bytes.len() as u64,
        })
        .collect();
    // The cache decides every alloc under one lock, across all api processes: a request
    // gets all its items or none (waiting in line, holding nothing, when full), so two
    // requests never hold parts of the capacity while waiting on each other.
    let wait_ms = wait.as_millis() as u64;
    let granted = state.cache.call(|c| async move { c.alloc(deadline(wait + t), alloc, wait_ms).await }).await??;
    guard.cache_ids = granted.records.iter().map(|r| r.id).collect();
    let (instance, records) = (granted.instance, granted.records);

    let mut written = Vec::new();
    for (item, rec) in items.iter().zip(&records) {
        if rec.write_data {
            let arena = state.arena_for(instance).await?;
            arena.write_data(rec.data_offset, &item.bytes).map_err(|e| ApiError::Internal(e.to_string()))?;
            written.push(rec.id);
        }
    }
    if !written.is_empty() {
        state.cache.call(|c| async move { c.set_items_data(deadline(t), written).await }).await??;
    }

    let mut missing: Vec<EncodeItem> = Vec::new();
    for r in records.iter().filter(|r| !r.embed_ready) {
        if !missing.iter().any(|m| m.id == r.id) {
            missing.push(EncodeItem {
                id: r.id,
                modality: Modality::Image,
                cache_instance: instance,
                data_offset: r.data_offset,
                data_len: r.data_len,
                start_index: r.start_index,
                token_num: r.token_num,
            });
        }
    }
    if !missing.is_empty() {
        let te = state.timeouts.encode;
        rpc("encoder", state.encoder.encode(deadline(te), missing).await)??;
    }
    Ok((instance, records))
}
