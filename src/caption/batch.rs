//! `--batch-file`: the OpenAI batch format (as `vllm run-batch` and OpenAI's batch API
//! take it). Each input line is `{"custom_id", "method": "POST", "url":
//! "/v1/chat/completions", "body": {…}}`; each output line is `{"id", "custom_id",
//! "response": {"status_code", "request_id", "body"}, "error"}`, in the order requests
//! finish. A line that is not a request is answered with an error for that line (its
//! `custom_id` if it has one, else `line N`). The output is the journal: resumed by
//! `custom_id`.

use anyhow::Context;
use serde_json::{Value, json};

use super::drive::{drive, outcome};
use super::journal::{Done, Journal};
use super::progress::Progress;
use super::{CaptionArgs, served_model};

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

/// Answers every request of `file` not answered before, appending to `--out`.
pub async fn run(args: &CaptionArgs, file: &std::path::Path, http: reqwest::Client, base: &str) -> anyhow::Result<()> {
    let mut journal = Journal::open(&args.out, &key)?;
    let done = std::mem::take(&mut journal.done);
    let model = served_model(&http, base, args.served_model.as_deref()).await?;
    let path = file.to_path_buf();
    let list = move |tx: tokio::sync::mpsc::Sender<(u64, String)>| -> anyhow::Result<()> {
        use std::io::BufRead;
        let f = std::fs::File::open(&path).with_context(|| format!("--batch-file {}", path.display()))?;
        for (n, line) in std::io::BufReader::new(f).lines().enumerate() {
            let line = line.with_context(|| format!("reading {}", path.display()))?;
            if !line.trim().is_empty() && tx.blocking_send((n as u64 + 1, line)).is_err() {
                break;
            }
        }
        Ok(())
    };
    let retry = args.retry_failed;
    let work = |(n, line): (u64, String)| {
        let (http, base, model, done) = (http.clone(), base.to_string(), model.clone(), &done);
        async move {
            let (id, mut body) = match parse_line(&line, n as usize) {
                Ok(x) => x,
                Err((id, _)) if done.contains_key(&id) && !retry => return None,
                Err((id, why)) => return Some(error_line(n, &id, "invalid_request", &why)),
            };
            if done.get(&id).is_some_and(|d| d.ok || !retry) {
                return None;
            }
            if body.get("model").is_none() {
                body["model"] = json!(model);
            }
            Some(match http.post(format!("{base}/v1/chat/completions")).json(&body).send().await {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    match resp.json::<Value>().await {
                        Ok(v) => response_line(n, &id, status, v),
                        Err(e) => error_line(n, &id, "bad_response", &e.to_string()),
                    }
                }
                Err(e) => error_line(n, &id, "request_failed", &e.to_string()),
            })
        }
    };
    let mut progress = Progress::new(args.quiet);
    let interrupted = drive(args.concurrency, list, work, &mut journal, &mut progress, |line, progress| {
        let c = &mut progress.counts;
        if key(line).is_some_and(|(_, d)| d.ok) {
            c.done += 1;
            c.output_tokens += line["response"]["body"]["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        } else {
            c.failed += 1;
        }
        Ok(())
    })
    .await?;
    journal.compact(&key)?;
    progress.summary(None);
    outcome(&progress, interrupted, "requests")
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
