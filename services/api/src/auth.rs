//! `--api-key`: every `/v1/*` request must carry `Authorization: Bearer <key>` for one of
//! the keys, compared in constant time; `/health` stays open, and `/metrics` unless
//! `--protect-metrics`. Without keys, everything is open.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// The accepted keys.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys(Arc<Vec<Vec<u8>>>);

impl ApiKeys {
    pub fn new(keys: &[String]) -> Self {
        ApiKeys(Arc::new(keys.iter().filter(|k| !k.is_empty()).map(|k| k.as_bytes().to_vec()).collect()))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `given` is one of the keys; the time taken depends on the lengths only.
    fn accepts(&self, given: &[u8]) -> bool {
        let mut ok = false;
        for key in self.0.iter() {
            ok |= same(key, given);
        }
        ok
    }
}

/// Equality of two byte strings without an early exit on the first difference.
fn same(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        diff |= u64::from(a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
}

/// The middleware on the `/v1` routes.
pub async fn require_key(State(keys): State<ApiKeys>, req: Request, next: Next) -> Response {
    if keys.is_empty() {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(key) if keys.accepts(key.as_bytes()) => next.run(req).await,
        Some(_) => ApiError::Unauthorized("Incorrect API key provided.".into()).into_response(),
        None => ApiError::Unauthorized("Missing API key: send `Authorization: Bearer <key>`.".into()).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_exactly_and_empty_ones_are_dropped() {
        let keys = ApiKeys::new(&["k1".into(), "longer-key".into(), String::new()]);
        assert!(keys.accepts(b"k1") && keys.accepts(b"longer-key"));
        assert!(!keys.accepts(b"k") && !keys.accepts(b"k12") && !keys.accepts(b"") && !keys.accepts(b"longer-kez"));
        assert!(ApiKeys::new(&[String::new()]).is_empty());
    }
}
