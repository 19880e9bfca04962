//! vLLM's `/tokenize` and `/detokenize`, in its request and response shapes. `/tokenize`
//! takes a `prompt` or chat `messages`; messages with media count each item's tokens as
//! the server would (the media fetched and checked from its header, as for a chat
//! request; nothing is encoded or reserved): the placeholder id repeated per token, as a
//! Hugging Face processor writes it.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::media::{RequestMedia, TokenBudget, prepare};
use crate::openai::Message;
use crate::state::AppState;

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default = "yes")]
    add_generation_prompt: bool,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    return_token_strs: bool,
    #[serde(default)]
    mm_processor_kwargs: Option<Map<String, Value>>,
    /// Rendered by the chat template, as for a chat request.
    #[serde(default)]
    tools: Option<Value>,
    #[serde(flatten)]
    other: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u32>,
    #[serde(flatten)]
    other: Map<String, Value>,
}

fn check(model: &Option<String>, other: &Map<String, Value>, state: &AppState) -> Result<(), ApiError> {
    if let Some(model) = model
        && !state.serves(model)
    {
        return Err(ApiError::ModelNotFound(model.clone()));
    }
    match other.keys().next() {
        Some(field) => Err(ApiError::bad_param(field, format!("`{field}` is not supported here"))),
        None => Ok(()),
    }
}

pub async fn tokenize(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    tokenize_inner(&state, &body).await.map_or_else(IntoResponse::into_response, |v| axum::Json(v).into_response())
}

async fn tokenize_inner(state: &Arc<AppState>, body: &[u8]) -> Result<Value, ApiError> {
    let req: TokenizeRequest =
        serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("invalid tokenize request: {e}")))?;
    check(&req.model, &req.other, state)?;
    let tokens = match (&req.prompt, &req.messages) {
        (Some(_), None) if req.tools.as_ref().is_some_and(|t| !t.is_null()) => {
            return Err(ApiError::bad_param("tools", "`tools` go with `messages`, not a `prompt`"));
        }
        (Some(prompt), None) => {
            crate::prompt::check_text_fits(prompt.len(), state.tokenizer.max_token_bytes(), state.max_model_len)?;
            let (st, text, special) = (state.clone(), prompt.clone(), req.add_special_tokens.unwrap_or(true));
            crate::cpu::run(&state.limits.cpu, "tokenizing prompts", move || {
                let ids = if special { st.tokenizer.encode_prompt(&text) } else { st.tokenizer.encode_plain(&text) };
                ids.map_err(|e| ApiError::Internal(e.to_string()))
            })
            .await??
        }
        (None, Some(messages)) => {
            if req.add_special_tokens == Some(true) {
                return Err(ApiError::bad_param(
                    "add_special_tokens",
                    "with `messages`, the chat template writes the special tokens",
                ));
            }
            let none = Value::from("none");
            let tools = crate::tools::Tools::parse(req.tools.as_ref(), Some(&none), state.tool_parser)
                .map_err(|(field, why)| ApiError::bad_param(field, why))?;
            let (sources, ids) = crate::generate::chat_prompt_ids(
                state,
                messages,
                tools.as_ref().map(|t| &t.list),
                req.add_generation_prompt,
                true,
            )
            .await?;
            let custom = RequestMedia::from_kwargs(req.mm_processor_kwargs.as_ref(), &state.limits, &state.model_name)?;
            let (limits, fingerprint) = match &custom {
                Some(c) => (&c.limits, c.fingerprint.as_str()),
                None => (&state.limits, state.fingerprint.as_str()),
            };
            let budget = TokenBudget::new(state.max_model_len, ids.len().saturating_sub(sources.len()) as u64);
            let items =
                futures::future::try_join_all(sources.iter().map(|s| prepare(s, limits, fingerprint, &budget))).await?;
            let mut counts = items.iter().map(|i| i.token_num as usize);
            let mut out = Vec::with_capacity(ids.len());
            for id in ids {
                let n = if id == state.item_token { counts.next().unwrap_or(1) } else { 1 };
                out.extend(std::iter::repeat_n(id, n));
            }
            out
        }
        _ => return Err(ApiError::bad("a tokenize request has either `prompt` or `messages`")),
    };
    let strs = req
        .return_token_strs
        .then(|| tokens.iter().map(|&t| state.tokenizer.id_to_token(t).unwrap_or_default()).collect::<Vec<_>>());
    Ok(json!({"count": tokens.len(), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": strs}))
}

pub async fn detokenize(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let run = || -> Result<Value, ApiError> {
        let req: DetokenizeRequest =
            serde_json::from_slice(&body).map_err(|e| ApiError::bad(format!("invalid detokenize request: {e}")))?;
        check(&req.model, &req.other, &state)?;
        if let Some(bad) = req.tokens.iter().find(|&&t| u64::from(t) >= state.vocab) {
            return Err(ApiError::bad_param(
                "tokens",
                format!("token id {bad} is outside the vocabulary ({})", state.vocab),
            ));
        }
        Ok(json!({"prompt": state.tokenizer.decode(&req.tokens, false)}))
    };
    run().map_or_else(IntoResponse::into_response, |v| axum::Json(v).into_response())
}
