//! Structured outputs through `mmserve serve` with the tiny LLaVA (whose free output is
//! gibberish): OpenAI's `response_format` (JSON schema, JSON object) and vLLM's
//! `structured_outputs` / `guided_*` (regex, choice, grammar) constrain every sampled
//! token, so every output parses and matches; bad constraints are a 400 before anything
//! runs; unconstrained requests in the same batch are unchanged.

mod common;

use common::*;
use serde_json::{Value, json};

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "item": {"type": "string", "maxLength": 12},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
            "price": {"type": "number", "minimum": 0, "maximum": 100},
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
            "store": {"type": "object", "properties": {"open": {"type": "boolean"}}, "required": ["open"],
                      "additionalProperties": false}
        },
        "required": ["item", "count", "price", "colors", "store"],
        "additionalProperties": false
    })
}

fn valid(v: &Value) -> bool {
    let o = v.as_object().unwrap();
    o.len() == 5
        && v["item"].as_str().is_some_and(|s| s.chars().count() <= 12)
        && v["count"].as_i64().is_some_and(|n| (1..=9).contains(&n))
        && v["price"].as_f64().is_some_and(|p| (0.0..=100.0).contains(&p))
        && v["colors"].as_array().is_some_and(|c| {
            (1..=3).contains(&c.len()) && c.iter().all(|x| ["red", "green", "blue"].iter().any(|k| x == k))
        })
        && v["store"]["open"].is_boolean()
        && v["store"].as_object().unwrap().len() == 1
}

fn request(extra: Value) -> Value {
    let mut body = image_request(&data_url(&fixture_png()), false);
    body["max_tokens"] = json!(160);
    body.as_object_mut().unwrap().remove("ignore_eos");
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("{v}")).to_string()
}

#[tokio::test]
async fn constrained_outputs_parse_and_match() {
    let server = Server::start(&[]);
    let format = json!({"type": "json_schema", "json_schema": {"name": "order", "schema": schema(), "strict": true}});
    // 50 seeded sampled requests at once: every one parses and validates.
    let answers = futures::future::join_all((0..50).map(|seed| {
        let body = request(json!({"response_format": format, "temperature": 1.0, "seed": seed}));
        let server = &server;
        async move { server.chat(&body).await }
    }))
    .await;
    for (seed, (status, v)) in answers.iter().enumerate() {
        assert_eq!(*status, 200, "seed {seed}: {v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "seed {seed}: {v}");
        let parsed: Value = serde_json::from_str(&content(v)).unwrap_or_else(|e| panic!("seed {seed}: {e}: {v}"));
        assert!(valid(&parsed), "seed {seed}: {parsed}");
    }
    // Reproducible: the same seed, the same output.
    let (_, again) = server.chat(&request(json!({"response_format": format, "temperature": 1.0, "seed": 7}))).await;
    assert_eq!(content(&again), content(&answers[7].1));

    // Streamed and not: the same (greedy) result.
    let (_, plain) = server.chat(&request(json!({"response_format": format, "temperature": 0}))).await;
    let mut streamed = request(json!({"response_format": format, "temperature": 0}));
    streamed["stream"] = json!(true);
    let r = server.http.post(format!("{}/v1/chat/completions", server.url)).json(&streamed).send().await.unwrap();
    let text = r.text().await.unwrap();
    let joined: String = text
        .split("\n\n")
        .filter_map(|f| f.strip_prefix("data: "))
        .filter(|f| *f != "[DONE]")
        .filter_map(|f| serde_json::from_str::<Value>(f).ok())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect();
    assert_eq!(joined, content(&plain));

    // A regex, a choice (both spellings), a grammar and any JSON object.
    let (_, v) =
        server.chat(&request(json!({"guided_regex": "[A-Z][a-z]{2,5} [0-9]{2}", "temperature": 1.0, "seed": 3}))).await;
    let t = content(&v);
    let (word, num) = t.split_once(' ').unwrap_or_else(|| panic!("{t:?}"));
    assert!(word.chars().next().unwrap().is_ascii_uppercase() && (3..=6).contains(&word.len()), "{t:?}");
    assert!(num.len() == 2 && num.chars().all(|c| c.is_ascii_digit()), "{t:?}");
    for (extra, options) in [
        (json!({"guided_choice": ["cat", "dog", "a red bird"]}), vec!["cat", "dog", "a red bird"]),
        (json!({"structured_outputs": {"choice": ["yes", "no"]}}), vec!["yes", "no"]),
    ] {
        for seed in 0..5 {
            let mut body = request(extra.clone());
            body["temperature"] = json!(1.0);
            body["seed"] = json!(seed);
            let (_, v) = server.chat(&body).await;
            assert!(options.contains(&content(&v).as_str()), "{v}");
        }
    }
    let lark = "start: \"(\" num (\"+\" num)* \")\"\nnum: /[0-9]{1,2}/";
    let (_, v) =
        server.chat(&request(json!({"structured_outputs": {"grammar": lark}, "temperature": 1.0, "seed": 1}))).await;
    let t = content(&v);
    assert!(
        t.starts_with('(')
            && t.ends_with(')')
            && t[1..t.len() - 1]
                .split('+')
                .all(|n| !n.is_empty() && n.len() <= 2 && n.chars().all(|c| c.is_ascii_digit())),
        "{t:?}"
    );
    let (_, v) = server
        .chat(&request(json!({"response_format": {"type": "json_object"}, "temperature": 0, "max_tokens": 300})))
        .await;
    if v["choices"][0]["finish_reason"] == "stop" {
        // Any JSON object: its numbers may be past f64 (JSON has no bound), so the shape.
        let t = content(&v);
        assert!(t.starts_with('{') && t.ends_with('}'), "{v}");
    }

    // Bad constraints: 400s that name the field, before anything runs.
    for (extra, param) in [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
            "response_format",
        ),
        (json!({"guided_regex": "(unclosed"}), "guided_regex"),
        (json!({"structured_outputs": {"grammar": "start: nowhere"}}), "structured_outputs"),
        (json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
        (json!({"response_format": {"type": "xml"}}), "response_format"),
        (json!({"guided_choice": ["a"], "guided_regex": "b"}), "guided_choice"),
    ] {
        let (status, v) = server.chat(&request(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{extra}: {v}");
    }
    assert_eq!(server.metric_becomes("mmserve_embed_cache_references", 0).await, 0);
    server.stop();
}

/// Unconstrained requests decoding beside constrained ones get the tokens they get alone.
#[tokio::test]
async fn unconstrained_requests_in_a_mixed_batch_are_unchanged() {
    let server = Server::start(&[]);
    let plain = |i: u64| {
        json!({"model": "llava-tiny", "messages": [{"role": "user", "content": format!("Hello number {i}")}],
               "max_tokens": 24, "temperature": 0, "ignore_eos": true, "return_token_ids": true})
    };
    let mut alone = Vec::new();
    for i in 0..4 {
        let (_, v) = server.chat(&plain(i)).await;
        alone.push(ids(&v["choices"][0]["token_ids"]));
    }
    let format = json!({"type": "json_schema", "json_schema": {"name": "order", "schema": schema()}});
    let constrained = (0..4).map(|seed| request(json!({"response_format": format, "temperature": 1.0, "seed": seed})));
    let mixed: Vec<Value> = (0..4).map(plain).chain(constrained).collect();
    let answers = futures::future::join_all(mixed.iter().map(|b| server.chat(b))).await;
    for (i, (status, v)) in answers.iter().enumerate() {
        assert_eq!(*status, 200, "{v}");
        if i < 4 {
            assert_eq!(ids(&v["choices"][0]["token_ids"]), alone[i], "request {i}");
        } else {
            assert!(valid(&serde_json::from_str(&content(v)).unwrap()), "{v}");
        }
    }
    server.stop();
}
