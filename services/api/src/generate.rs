//! One request's way through the services: check and key the media, reserve every
//! item at once in the embed cache, write new items' bytes to shared memory, have the
//! encoder fill the missing embeddings, submit to the engine. A [`RequestGuard`] owns
//! what the request holds and gives it back however the request ends.

use std::sync::Arc;

use mmserve_protocol::reconnect::Lease;
use mmserve_protocol::{
    AllocItem, Constraint, EncodeItem, GenerateRequest, ItemRecord, ItemSpan, Modality, OutputEvent, RpcFailure,
    SamplingParams, deadline,
};
use tokio::sync::mpsc;

use crate::cpu;
use crate::error::ApiError;
use crate::load::Queued;
use crate::media::{MediaItem, RequestMedia, TokenBudget, check_kind, prepare};
use crate::openai::{ChatRequest, RawPrompt};
use crate::prompt::ItemSource;
use crate::prompt::{check_text_fits, expand, mark_literal, parse_messages, tokenize};
use crate::state::AppState;
use crate::tools::Tools;
use crate::truncate::{TruncationMode, truncate};

/// Holds a request's cache references and its place in the engine. Dropping it (the
/// request finished, failed, or its client went away at any await) aborts the engine
/// request if it is still running and then gives back its cache lease, which releases
/// every reference granted under it exactly once, even a grant the request never saw.
pub struct RequestGuard {
    state: Arc<AppState>,
    /// Engine requests (one per choice) submitted and not yet finished.
    running: Vec<u64>,
    /// Exists before the alloc is sent.
    lease: Option<Lease>,
    /// The request's place among those waiting for their first token.
    queued: Queued,
}

impl RequestGuard {
    /// The request produced its first event: it no longer counts as queued.
    pub fn first_token(&mut self) {
        self.queued.leave();
    }

    /// The engine finished this choice by itself: no abort needed.
    pub fn mark_finished(&mut self, request_id: u64) {
        self.running.retain(|&r| r != request_id);
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        let abort = std::mem::take(&mut self.running);
        let lease = self.lease.take();
        if abort.is_empty() {
            return; // the lease, if any, is given back as it drops here
        }
        let state = self.state.clone();
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        rt.spawn(async move {
            let t = state.timeouts.rpc;
            for request_id in abort {
                state.dispatcher.unregister(request_id);
                if let Err(e) = state.engine.abort(deadline(t), request_id).await {
                    tracing::warn!("aborting request {request_id}: {e}");
                }
            }
            // Only now may the items' slots go: the engine no longer reads them.
            drop(lease);
        });
    }
}

/// A request accepted by the engine.
pub struct Started {
    pub guard: RequestGuard,
    /// One event stream per choice (`n`), in choice order: (engine request id, events).
    pub choices: Vec<(u64, mpsc::UnboundedReceiver<OutputEvent>)>,
    pub prompt_ids: Vec<u64>,
    /// Prompt tokens that stand for images, and for audio.
    pub image_tokens: u64,
    pub audio_tokens: u64,
    /// The request's items found in the embed cache, and those it added.
    pub embed_hits_misses: (u64, u64),
    /// The request's tools, when it has any (its choices' output is read for calls).
    pub tools: Option<Tools>,
}

fn rpc<T>(service: &'static str, r: Result<T, tarpc::client::RpcError>) -> Result<T, ApiError> {
    r.map_err(|e| RpcFailure::new(service, e).into())
}

/// Prompts with more text than this hand the memory their tokenizing took back to the
/// system (the process keeps freed memory otherwise; see `keep_freed_memory`).
const LARGE_TEXT: usize = 1 << 20;

fn give_memory_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Most choices per request and stop strings per request.
const MAX_N: u32 = 16;
const MAX_STOPS: usize = 16;

/// The request's sampling fields, checked: the parameters and the number of choices.
pub fn sampling(
    req: &ChatRequest,
    constraint: Option<Constraint>,
    prompt_len: u64,
    max_model_len: u64,
    vocab: u64,
) -> Result<(SamplingParams, usize), ApiError> {
    let n = req.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::bad_param("n", format!("n must be between 1 and {MAX_N}")));
    }
    let stop: Vec<String> = match &req.stop {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::String(s)) => vec![s.clone()],
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(|| ApiError::bad_param("stop", "stop must be strings")))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::bad_param("stop", "stop must be a string or a list of strings")),
    };
    if stop.len() > MAX_STOPS || stop.iter().any(|s| s.is_empty() || s.len() > 256) {
        return Err(ApiError::bad_param("stop", format!("at most {MAX_STOPS} non-empty stop strings of ≤ 256 bytes")));
    }
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::bad_param("top_logprobs", "top_logprobs needs logprobs: true"));
        }
        (_, Some(k)) if k > 20 => return Err(ApiError::bad_param("top_logprobs", "top_logprobs must be at most 20")),
        (true, k) => Some(k.unwrap_or(0)),
        (false, _) => None,
    };
    let temperature = req.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad_param("temperature", "temperature must be between 0 and 2"));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad_param("top_p", "top_p must be in (0, 1]"));
    }
    let top_k = match req.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
        _ => return Err(ApiError::bad_param("top_k", "top_k must be -1, 0 (off) or positive")),
    };
    let min_p = req.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::bad_param("min_p", "min_p must be between 0 and 1"));
    }
    let repetition_penalty = req.repetition_penalty.unwrap_or(1.0);
    if !(repetition_penalty > 0.0 && repetition_penalty.is_finite()) {
        return Err(ApiError::bad_param("repetition_penalty", "repetition_penalty must be positive"));
    }
    let (presence_penalty, frequency_penalty) =
        (req.presence_penalty.unwrap_or(0.0), req.frequency_penalty.unwrap_or(0.0));
    for (name, v) in [("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)] {
        if !(-2.0..=2.0).contains(&v) {
            return Err(ApiError::bad_param(name, format!("{name} must be between -2 and 2")));
        }
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
    let min_tokens = req.min_tokens.unwrap_or(0);
    if u64::from(min_tokens) > max_tokens {
        return Err(ApiError::bad_param("min_tokens", "min_tokens must not exceed max_tokens"));
    }
    let mut logit_bias = Vec::new();
    for (token, &bias) in req.logit_bias.iter().flatten() {
        let bad = |why: &str| ApiError::bad_param("logit_bias", format!("logit_bias[{token:?}]: {why}"));
        let id: u32 = token.trim().parse().map_err(|_| bad("keys are token ids"))?;
        if u64::from(id) >= vocab {
            return Err(bad(&format!("this model's token ids are below {vocab}")));
        }
        if !(-100.0..=100.0).contains(&bias) {
            return Err(bad("biases are between -100 and 100"));
        }
        logit_bias.push((id, bias as f32));
    }
    logit_bias.sort_by_key(|&(id, _)| id);
    let params = SamplingParams {
        max_tokens: max_tokens as u32,
        min_tokens,
        temperature,
        top_p,
        top_k,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        seed: req.seed,
        logit_bias,
        constraint,
        ignore_eos: req.ignore_eos,
        stop_token_ids: req.stop_token_ids.clone(),
        stop,
        logprobs,
        skip_special_tokens: req.skip_special_tokens.unwrap_or(true),
    };
    Ok((params, n as usize))
}

/// `log_id`: the request's client-facing id, passed to the services for their logs.
pub async fn start(
    state: &Arc<AppState>,
    req: &ChatRequest,
    mut queued: Queued,
    log_id: &str,
) -> Result<Started, ApiError> {
    if let Some(model) = &req.model
        && !state.serves(model)
    {
        return Err(ApiError::ModelNotFound(model.clone()));
    }
    let cut = truncation(state, req)?;
    // A prompt that may be cut is not refused for its length before it is.
    let bounded = cut.is_none();
    let tools = Tools::parse(req.tools.as_ref(), req.tool_choice.as_ref(), state.tool_parser)
        .map_err(|(field, why)| ApiError::bad_param(field, why))?
        .map(|t| t.at_most_one_call(req.parallel_tool_calls == Some(false)));
    let constraint = output_constraint(req, tools.as_ref())?;
    let (sources, mut ids) = match &req.raw_prompt {
        Some(prompt) => (Vec::new(), raw_prompt_ids(state, prompt, bounded).await?),
        None => chat_prompt_ids(state, &req.messages, tools.as_ref().map(|t| &t.list), true, bounded).await?,
    };

    // Media: fetched, checked and keyed, all items at once.
    let context = if bounded { state.max_model_len } else { u64::MAX };
    let budget = TokenBudget::new(context, (ids.len() as u64).saturating_sub(sources.len() as u64));
    let custom = RequestMedia::from_kwargs(req.mm_processor_kwargs.as_ref(), &state.limits, &state.model_name)?;
    let (limits, fingerprint) = match &custom {
        Some(c) => (&c.limits, c.fingerprint.as_str()),
        None => (&state.limits, state.fingerprint.as_str()),
    };
    let mut items: Vec<MediaItem> =
        futures::future::try_join_all(sources.iter().map(|src| prepare(src, limits, fingerprint, &budget))).await?;
    if let Some((keep, mode, param)) = cut {
        let sizes: Vec<u32> = items.iter().map(|i| i.token_num).collect();
        let (kept, kept_items) =
            truncate(&ids, state.item_token, &sizes, keep, mode).map_err(|e| ApiError::bad_param(param, e))?;
        ids = kept;
        let mut all: Vec<Option<MediaItem>> = items.into_iter().map(Some).collect();
        items = kept_items.into_iter().filter_map(|i| all.get_mut(i).and_then(Option::take)).collect();
    }
    let tokens_of =
        |m: Modality| -> u64 { items.iter().filter(|i| i.modality == m).map(|i| u64::from(i.token_num)).sum() };
    let (image_tokens, audio_tokens) = (tokens_of(Modality::Image), tokens_of(Modality::Audio));
    let prompt_len = (ids.len() as u64).saturating_sub(items.len() as u64) + image_tokens + audio_tokens;
    let (params, n) =
        sampling(req, constraint.as_ref().map(|c| c.1.clone()), prompt_len, state.max_model_len, state.vocab)?;
    check_constraint(state, constraint).await?;
    queued.add_prompt_tokens(prompt_len)?;

    let request_id = state.new_request_id();
    let mut guard = RequestGuard { state: state.clone(), running: Vec::new(), lease: None, queued };
    let (cache_instance, records) = reserve(state, &items, &mut guard, log_id).await?;
    let misses = records.iter().filter(|r| r.write_data).count() as u64;
    let embed_hits_misses = (records.len() as u64 - misses, misses);

    let ranges: Vec<(u64, u32)> = records.iter().map(|r| (r.token_id, r.token_num)).collect();
    let prompt_ids = expand(&ids, state.item_token, &ranges)?;
    // Qwen-VL: each image's block of tokens takes its grid's positions.
    let positions = if state.mrope && items.iter().any(|i| i.grid.is_some()) {
        let grids: Vec<(u64, (usize, usize))> =
            records.iter().zip(&items).filter_map(|(r, i)| i.grid.map(|g| (r.token_id, g))).collect();
        Some(mrope_prompt(&prompt_ids, &grids))
    } else {
        None
    };
    let mut spans: Vec<ItemSpan> = Vec::new();
    for r in &records {
        if !spans.iter().any(|s| s.token_id == r.token_id) {
            spans.push(ItemSpan { token_id: r.token_id, token_num: r.token_num, start_index: r.start_index });
        }
    }

    // `n` choices are sibling engine requests over the same prompt; with a seed, choice
    // i samples with seed + i (so the choices differ and each is reproducible).
    let mut choices = Vec::with_capacity(n);
    let mut requests = Vec::with_capacity(n);
    for i in 0..n as u64 {
        let id = if i == 0 { request_id } else { state.new_request_id() };
        let mut params = params.clone();
        params.seed = params.seed.map(|s| s.wrapping_add(i));
        let events = state.dispatcher.register(id);
        let request = GenerateRequest {
            id,
            client: state.client_id,
            prompt_ids: prompt_ids.clone(),
            items: spans.clone(),
            cache_instance,
            params,
            sibling_of: (i > 0).then_some(request_id),
            positions: positions.clone(),
            request_id: log_id.to_string(),
        };
        // Marked before the call: if this handler is dropped after the engine accepted the
        // request, the guard still aborts it (aborting an unknown id is harmless).
        guard.running.push(id);
        choices.push((id, events));
        requests.push(request);
    }
    rpc("engine", state.engine.submit(deadline(state.timeouts.rpc), requests).await)??;
    Ok(Started { guard, choices, prompt_ids, image_tokens, audio_tokens, embed_hits_misses, tools })
}

/// The request's output constraint and the field that asked for it: a structured-output
/// field, or the tools when `tool_choice` is `"required"` or a named function (not both).
pub fn output_constraint(
    req: &ChatRequest,
    tools: Option<&Tools>,
) -> Result<Option<(&'static str, Constraint)>, ApiError> {
    let asked = req.constraint().map_err(|(field, why)| ApiError::bad_param(&field, why))?;
    match (asked, tools.and_then(Tools::constraint)) {
        (Some((field, _)), Some(_)) => Err(ApiError::bad_param(
            "tool_choice",
            format!(
                "tool_choice \"required\" or a named function constrains the output; it cannot be combined with `{field}`"
            ),
        )),
        (Some(asked), None) => Ok(Some(asked)),
        (None, tool) => Ok(tool.map(|c| ("tools", c))),
    }
}

/// Compiles the request's output constraint (on the CPU pool; cached for the engine's
/// identical compile), so that a bad schema, regex or grammar is a 400 that says what is
/// wrong, before anything is reserved.
async fn check_constraint(
    state: &Arc<AppState>,
    constraint: Option<(&'static str, Constraint)>,
) -> Result<(), ApiError> {
    let Some((field, c)) = constraint else {
        return Ok(());
    };
    let grammars = state.grammars.clone();
    cpu::run(&state.limits.cpu, "compiling the output constraint", move || match grammars.matcher(&c) {
        Ok(_) => Ok(()),
        Err(mmserve_grammar::GrammarError::Invalid(why)) => Err(ApiError::bad_param(field, format!("{field}: {why}"))),
        Err(e) => Err(ApiError::Internal(e.to_string())),
    })
    .await?
}

/// How a request's prompt is cut if it is too long: to at most how many tokens, where,
/// and the field a refusal names. `None`: it is not cut (a prompt past the context is
/// refused).
fn truncation(state: &AppState, req: &ChatRequest) -> Result<Option<(usize, TruncationMode, &'static str)>, ApiError> {
    let context = state.max_model_len as usize;
    match req.truncate_prompt_tokens {
        Some(-1) => Ok(Some((context, TruncationMode::Head, "truncate_prompt_tokens"))),
        Some(k) if k >= 1 && k as usize <= context => {
            Ok(Some((k as usize, TruncationMode::Head, "truncate_prompt_tokens")))
        }
        Some(_) => Err(ApiError::bad_param(
            "truncate_prompt_tokens",
            format!("truncate_prompt_tokens must be -1 (the context) or from 1 to this model's context of {context}"),
        )),
        None if state.truncation == TruncationMode::None => Ok(None),
        None => {
            // Room for the answer: what it asks for, else an eighth of the context.
            let answer = req.max_completion_tokens.or(req.max_tokens).map_or(context / 8, |n| n as usize);
            let param = if req.raw_prompt.is_some() { "prompt" } else { "messages" };
            Ok(Some((context.saturating_sub(answer).max(1), state.truncation, param)))
        }
    }
}

/// A chat request's media items and its prompt's ids: the messages checked, rendered by
/// the chat template and tokenized (off the event loop), one placeholder per item.
/// `bounded`: text that cannot fit the context is refused before it is tokenized.
pub(crate) async fn chat_prompt_ids(
    state: &Arc<AppState>,
    messages: &[crate::openai::Message],
    tools: Option<&serde_json::Value>,
    add_generation_prompt: bool,
    bounded: bool,
) -> Result<(Vec<ItemSource>, Vec<u32>), ApiError> {
    let parsed = parse_messages(messages)?;
    if parsed.items.len() > state.limits.max_items {
        return Err(ApiError::bad_param(
            "messages",
            format!(
                "{} media items in one request; the limit is {} (--max-items-per-request)",
                parsed.items.len(),
                state.limits.max_items
            ),
        ));
    }
    for src in &parsed.items {
        check_kind(src, &state.limits.model, &state.model_name)?;
    }
    if bounded {
        check_text_fits(parsed.text_bytes, state.tokenizer.max_token_bytes(), state.max_model_len)?;
    }
    // Moved, not copied: a prompt's text may be megabytes.
    let (st, mut messages, text_bytes) = (state.clone(), parsed.template_messages, parsed.text_bytes);
    let tools = tools.cloned();
    let ids = cpu::run(&state.limits.cpu, "tokenizing prompts", move || {
        if let Some(marks) = &st.literal_marks {
            mark_literal(&mut messages, marks, &st.tokenizer);
        }
        let ids = tokenize(
            &st.template,
            &st.tokenizer,
            &messages,
            tools.as_ref(),
            st.literal_marks.as_ref(),
            add_generation_prompt,
        );
        drop(messages);
        if text_bytes > LARGE_TEXT {
            give_memory_back();
        }
        ids
    })
    .await??;
    Ok((parsed.items, ids))
}

/// A completion request's prompt ids: its text tokenized as is (the tokenizer adds its
/// special tokens, BOS among them), or its ids checked against the vocabulary.
async fn raw_prompt_ids(state: &Arc<AppState>, prompt: &RawPrompt, bounded: bool) -> Result<Vec<u32>, ApiError> {
    match prompt {
        RawPrompt::Ids(ids) => {
            if let Some(bad) = ids.iter().find(|&&id| u64::from(id) >= state.vocab) {
                return Err(ApiError::bad_param(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary ({})", state.vocab),
                ));
            }
            Ok(ids.clone())
        }
        RawPrompt::Text(text) => {
            if bounded {
                check_text_fits(text.len(), state.tokenizer.max_token_bytes(), state.max_model_len)?;
            }
            let (st, text) = (state.clone(), text.clone());
            cpu::run(&state.limits.cpu, "tokenizing prompts", move || {
                st.tokenizer.encode_prompt(&text).map_err(|e| ApiError::Internal(e.to_string()))
            })
            .await?
        }
    }
}

/// Reserves every item at once, writes the bytes of items this request created, and
/// waits until every item's embedding is in the arena. Returns the cache instance and
/// the records.
async fn reserve(
    state: &AppState,
    items: &[MediaItem],
    guard: &mut RequestGuard,
    log_id: &str,
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
    let lease = guard.lease.insert(state.cache.lease());
    let granted = state.cache.alloc(lease, alloc, wait, t).await??;
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
        state.cache.set_items_data(written).await??;
    }

    let mut missing: Vec<EncodeItem> = Vec::new();
    for (item, r) in items.iter().zip(&records).filter(|(_, r)| !r.embed_ready) {
        if !missing.iter().any(|m| m.id == r.id) {
            missing.push(EncodeItem {
                id: r.id,
                modality: item.modality,
                cache_instance: instance,
                data_offset: r.data_offset,
                data_len: r.data_len,
                start_index: r.start_index,
                token_num: r.token_num,
                pixel_bounds: item.pixel_bounds,
            });
        }
    }
    if !missing.is_empty() {
        let te = state.timeouts.encode;
        let timings = rpc("encoder", state.encoder.encode(deadline(te), log_id.to_string(), missing).await)??;
        crate::metrics::encoded(&timings);
    }
    Ok((instance, records))
}

/// The M-RoPE positions of an expanded prompt whose items (by first virtual id) lay out
/// `grids` of merged patches: text runs count up, each image's block takes its grid.
fn mrope_prompt(prompt_ids: &[u64], grids: &[(u64, (usize, usize))]) -> mmserve_protocol::MropePrompt {
    use mmserve_media::mrope::{Span, mrope_positions};
    let mut spans = Vec::new();
    let mut i = 0;
    let mut text = 0;
    while i < prompt_ids.len() {
        match grids.iter().find(|(start, _)| *start == prompt_ids[i]) {
            Some(&(_, (h, w))) => {
                if text > 0 {
                    spans.push(Span::Text(text));
                    text = 0;
                }
                spans.push(Span::Image { t: 1, h, w });
                i += h * w;
            }
            None => {
                text += 1;
                i += 1;
            }
        }
    }
    if text > 0 {
        spans.push(Span::Text(text));
    }
    let (streams, delta) = mrope_positions(&spans);
    mmserve_protocol::MropePrompt { streams, delta }
}
