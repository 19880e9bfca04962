//! `--batch-file`: the OpenAI batch format (as `vllm run-batch` and OpenAI's batch API
//! take it). Each input line is `{"custom_id", "method": "POST", "url":
//! "/v1/chat/completions", "body": {…}}`; each output line is `{"id", "custom_id",
//! "response": {"status_code", "request_id", "body"}, "error"}`, in the order requests
//! finish. A line that is not a request is answered with an error for that line (its
//! `custom_id` if it has one, else `line N`). The output is the journal: resumed by
//! `custom_id`.

use serde_json::{Value, json};

use super::journal::Done;

/// A parsed input line: (custom_id, body), or the line's id and what is wrong.
pub fn parse_line(line: &str, n: usize) -> Result<(String, Value), (String, String)> {
    let v: Value = serde_json::from_str(line).map_err(|e| (format!("line {n}"), format!("not JSON: {e}")))?;
    let id = match v.get("custom_id") {
        Some(Value::String(s)) => s.clone(),
        _ => return Err((format!("line {n}"), "no \"custom_id\" string".into())),
    };
    let method = v.get("method").and_then(Value::as_str).unwrap_or("POST");
    if !method.eq_ignore_ascii_case("POST") {
        return Err((id, format!("method {method:?}: only POST is served")));
    }
    match v.get("url").and_then(Value::as_str) {
        Some("/v1/chat/completions") => {}
        other => return Err((id, format!("url {other:?}: only /v1/chat/completions is served"))),
    }
    match v.get("body") {
        Some(body @ Value::Object(_)) => Ok((id, body.clone())),
        _ => Err((id, "no \"body\" object".into())),
    }
}

/// An output line for a request that was answered (any status).
pub fn response_line(n: u64, custom_id: &str, status: u16, body: Value) -> Value {
    json!({
        "id": format!("batch_req_{n}"),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": format!("req_{n}"), "body": body},
        "error": null,
    })
}

/// An output line for a request that never got an answer (bad line, no connection).
pub fn error_line(n: u64, custom_id: &str, code: &str, message: &str) -> Value {
    json!({
        "id": format!("batch_req_{n}"),
        "custom_id": custom_id,
        "response": null,
        "error": {"code": code, "message": message},
    })
}

/// The resume key of an output line: its `custom_id`, done when answered with a 2xx.
pub fn key(v: &Value) -> Option<(String, Done)> {
    let id = v.get("custom_id")?.as_str()?.to_string();
    let ok = v["error"].is_null() && v["response"]["status_code"].as_u64().is_some_and(|s| (200..300).contains(&s));
    Some((id, Done { digest: String::new(), settings: String::new(), ok }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_requests_or_say_what_is_wrong() {
        let good = r#"{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}"#;
        assert_eq!(parse_line(good, 1).unwrap().0, "r1");
        assert_eq!(parse_line("{", 2).unwrap_err().0, "line 2");
        let get = r#"{"custom_id": "r3", "method": "GET", "url": "/v1/chat/completions", "body": {}}"#;
        assert_eq!(parse_line(get, 3).unwrap_err(), ("r3".to_string(), "method \"GET\": only POST is served".into()));
        let emb = r#"{"custom_id": "r4", "url": "/v1/embeddings", "body": {}}"#;
        assert!(parse_line(emb, 4).unwrap_err().1.contains("only /v1/chat/completions"));
        assert!(key(&response_line(1, "a", 200, json!({}))).unwrap().1.ok);
        assert!(!key(&response_line(2, "b", 400, json!({}))).unwrap().1.ok);
        assert!(!key(&error_line(3, "c", "invalid_request", "x")).unwrap().1.ok);
    }
}
