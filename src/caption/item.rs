//! One item's way to a record: its bytes (read or fetched, capped), its content digest,
//! what it is (by content), whether an earlier run did it already, the request, and the
//! answer (or the error) as the journal's record.

use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::{Value, json};

use super::inputs::{self, Item, Kind, Next, Source};
use super::journal::Done;
use super::request::{self, Answer, Settings};

/// What every item's task shares.
pub struct Shared {
    pub http: reqwest::Client,
    pub base: String,
    pub settings: Settings,
    pub done: HashMap<String, Done>,
    pub retry_failed: bool,
    pub max_bytes: u64,
    /// Answers of this run by (digest, settings key), when the settings are
    /// deterministic: a duplicate reuses the first one's.
    pub answers: Mutex<HashMap<(String, String), Answer>>,
}

fn record(item: &Item, fields: Value) -> Value {
    let mut r = json!({"id": item.id});
    match &item.source {
        Source::File(p) => r["path"] = json!(p.to_string_lossy()),
        Source::Url(u) => r["url"] = json!(u),
    }
    if let Some(root) = &item.root {
        r["root"] = json!(root.to_string_lossy());
    }
    if let (Value::Object(r), Value::Object(f)) = (&mut r, fields) {
        r.extend(f);
    }
    r
}

fn failure(item: &Item, digest: Option<&str>, settings: Option<&str>, error: impl std::fmt::Display) -> Option<Value> {
    Some(record(item, json!({"digest": digest, "settings": settings, "caption": null, "error": error.to_string()})))
}

/// The journal line of one input, or `None` when an earlier run did it.
pub async fn process(s: &Shared, next: Next) -> Option<Value> {
    let item = match next {
        Ok(item) => item,
        // An input that is not one (a glob that matches nothing, a bad jsonl line).
        Err(bad) if s.done.contains_key(&bad.id) && !s.retry_failed => return None,
        Err(bad) => return Some(json!({"id": bad.id, "caption": null, "error": bad.error})),
    };
    // An item that could not even be read last time stays failed unless retried.
    if let Some(d) = s.done.get(&item.id)
        && d.digest.is_empty()
        && !d.ok
        && !s.retry_failed
    {
        return None;
    }
    let bytes = match &item.source {
        Source::File(p) => request::read_file(p, s.max_bytes).await,
        Source::Url(u) => request::fetch(&s.http, u, s.max_bytes).await,
    };
    let bytes = match bytes {
        Ok(b) => b,
        Err(e) => return failure(&item, None, None, format!("reading: {e}")),
    };
    let digest = request::digest(&bytes);
    let Some(kind) = inputs::sniff(&bytes) else {
        let named_media = match &item.source {
            Source::File(p) => inputs::has_media_extension(p),
            Source::Url(_) => true,
        };
        if item.walked && !named_media {
            if s.done.get(&item.id).is_some_and(|d| d.ok && d.digest == digest) {
                return None;
            }
            // A file beside the media of a folder: noted, not a failure.
            let note = "not an image or audio file (by its content)";
            return Some(record(&item, json!({"digest": digest, "caption": null, "not_media": note, "error": null})));
        }
        return failure(&item, Some(&digest), None, "not an image or audio file (by its content)");
    };
    // A clip's length from its container, where it states one (for the summary's rate).
    let seconds = match kind {
        Kind::Audio(format) => mmserve_media::audio::probe_duration(&bytes, Some(format)).ok().flatten(),
        Kind::Image => None,
    };
    let prompt = s.settings.prompt_for(kind, item.prompt.as_deref()).to_string();
    let key = s.settings.key(&prompt);
    if let Some(d) = s.done.get(&item.id)
        && d.digest == digest
        && d.settings == key
        && (d.ok || !s.retry_failed)
    {
        return None;
    }
    let cached = s.settings.deterministic().then(|| lock(&s.answers).get(&(digest.clone(), key.clone())).cloned());
    let answer = match cached.flatten() {
        Some(a) => Ok(a),
        None => {
            let body = s.settings.body(kind, &bytes, &prompt);
            drop(bytes);
            let answer = request::complete(&s.http, &s.base, &body).await;
            if let Ok(a) = &answer
                && s.settings.deterministic()
            {
                lock(&s.answers).insert((digest.clone(), key.clone()), a.clone());
            }
            answer
        }
    };
    let kind_name = match kind {
        Kind::Image => "image",
        Kind::Audio(_) => "audio",
    };
    match answer {
        Ok(a) => Some(record(
            &item,
            json!({
                "kind": kind_name, "digest": digest, "settings": key, "caption": a.caption,
                "prompt_tokens": a.prompt_tokens, "completion_tokens": a.completion_tokens,
                "finish_reason": a.finish_reason, "latency_ms": (a.latency.as_secs_f64() * 1e4).round() / 10.0,
                "audio_seconds": seconds, "error": null,
            }),
        )),
        Err(e) => failure(&item, Some(&digest), Some(&key), e),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
