//! Tool calling through `mmserve serve`: `tool_choice` `"required"` and a named function
//! constrain the tiny LLaVA's (gibberish) output to valid calls, read into `tool_calls`;
//! `"auto"` reads a Qwen-style `<tool_call>` block (forced here by a regex) on the tiny
//! Qwen2.5-VL served with a Hermes template; streamed and non-streamed agree; assistant
//! `tool_calls` and `tool` messages round-trip through the chat template; bad tool
//! requests are 400s that name the field.

mod common;

use common::*;
use serde_json::{Value, json};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "unit": {"enum": ["celsius", "fahrenheit"]}
                },
                "required": ["city", "unit"],
                "additionalProperties": false
            }
        }},
        {"type": "function", "function": {
            "name": "count_items",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["n"],
                "additionalProperties": false
            }
        }}
    ])
}

/// Whether a call's name and arguments fit the tools above.
fn valid_call(name: &str, arguments: &str) -> bool {
    let Ok(args) = serde_json::from_str::<Value>(arguments) else { return false };
    let Some(o) = args.as_object() else { return false };
    match name {
        "get_weather" => {
            o.len() == 2
                && args["city"].as_str().is_some_and(|c| c.chars().count() <= 10)
                && (args["unit"] == "celsius" || args["unit"] == "fahrenheit")
        }
        "count_items" => o.len() == 1 && args["n"].as_i64().is_some_and(|n| (0..=99).contains(&n)),
        _ => false,
    }
}

fn request(extra: Value) -> Value {
    let mut body = image_request(&data_url(&fixture_png()), false);
    body["max_tokens"] = json!(200);
    body["tools"] = tools();
    let o = body.as_object_mut().unwrap();
    o.remove("ignore_eos");
    o.remove("return_token_ids");
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// A message's calls as (name, arguments).
fn calls(v: &Value) -> Vec<(String, String)> {
    v["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("no tool_calls: {v}"))
        .iter()
        .map(|c| {
            assert_eq!(c["type"], "function", "{v}");
            assert!(c["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{v}");
            (
                c["function"]["name"].as_str().unwrap().to_string(),
                c["function"]["arguments"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// A streamed answer's calls gathered from `delta.tool_calls`, its content, and its
/// finish reason.
async fn streamed(server: &Server, body: &Value) -> (Vec<(String, String)>, String, String) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = server.http.post(format!("{}/v1/chat/completions", server.url)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let (mut calls, mut content, mut finish) = (Vec::<(String, String)>::new(), String::new(), String::new());
    for frame in text.split("\n\n").filter_map(|f| f.strip_prefix("data: ")).filter(|f| *f != "[DONE]") {
        let chunk: Value = serde_json::from_str(frame).unwrap();
        let choice = &chunk["choices"][0];
        if let Some(t) = choice["delta"]["content"].as_str() {
            content.push_str(t);
        }
        for d in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let index = d["index"].as_u64().unwrap() as usize;
            if let Some(name) = d["function"]["name"].as_str() {
                assert_eq!(index, calls.len(), "{frame}");
                assert!(d["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{frame}");
                calls.push((name.to_string(), String::new()));
            }
            calls[index].1.push_str(d["function"]["arguments"].as_str().unwrap());
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (calls, content, finish)
}

#[tokio::test]
async fn required_and_named_tool_choices_give_valid_calls() {
    let server = Server::start(&[]);
    // "required", one call a request: ten seeded sampled requests all call a tool validly.
    let answers = futures::future::join_all((0..10).map(|seed| {
        let body = request(json!({"tool_choice": "required", "parallel_tool_calls": false, "temperature": 1.0,
                                  "seed": seed}));
        let server = &server;
        async move { server.chat(&body).await }
    }))
    .await;
    for (seed, (status, v)) in answers.iter().enumerate() {
        assert_eq!(*status, 200, "seed {seed}: {v}");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "seed {seed}: {v}");
        assert!(v["choices"][0]["message"]["content"].is_null(), "seed {seed}: {v}");
        let c = calls(v);
        assert_eq!(c.len(), 1, "seed {seed}: {v}");
        assert!(valid_call(&c[0].0, &c[0].1), "seed {seed}: {v}");
    }
    // Parallel calls allowed: every call made is valid.
    let (status, v) =
        server.chat(&request(json!({"tool_choice": "required", "temperature": 0, "max_tokens": 400}))).await;
    assert_eq!(status, 200, "{v}");
    if v["choices"][0]["finish_reason"] == "tool_calls" {
        assert!(calls(&v).iter().all(|(n, a)| valid_call(n, a)), "{v}");
    } else {
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    }

    // Streamed and not: the same calls (greedy).
    let greedy = request(json!({"tool_choice": "required", "parallel_tool_calls": false, "temperature": 0}));
    let (_, plain) = server.chat(&greedy).await;
    let (s_calls, s_content, s_finish) = streamed(&server, &greedy).await;
    assert_eq!(s_calls, calls(&plain));
    assert_eq!((s_content.as_str(), s_finish.as_str()), ("", "tool_calls"));

    // A named function: its arguments, finish "stop" (as OpenAI's), streamed in fragments.
    let named = request(json!({"tool_choice": {"type": "function", "function": {"name": "count_items"}},
                               "temperature": 1.0, "seed": 5}));
    let (status, v) = server.chat(&named).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let c = calls(&v);
    assert!(c.len() == 1 && c[0].0 == "count_items" && valid_call(&c[0].0, &c[0].1), "{v}");
    let (s_calls, _, s_finish) = streamed(&server, &named).await;
    assert_eq!((s_calls, s_finish.as_str()), (c, "stop"));

    // "none": text, no calls; "auto" without a tool-call format in the template: a 400.
    let (status, v) = server.chat(&request(json!({"tool_choice": "none", "max_tokens": 8}))).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string() && v["choices"][0]["message"]["tool_calls"].is_null());
    for extra in [json!({}), json!({"tool_choice": "auto"})] {
        let (status, v) = server.chat(&request(extra)).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some("tool_choice")), "{v}");
    }

    // A round trip: the assistant's call and the tool's answer go back through the template.
    let (_, first) = server.chat(&greedy).await;
    let assistant = first["choices"][0]["message"].clone();
    let call_id = assistant["tool_calls"][0]["id"].clone();
    let mut body = request(json!({"tool_choice": "none", "max_tokens": 8}));
    body["messages"]
        .as_array_mut()
        .unwrap()
        .extend([assistant, json!({"role": "tool", "tool_call_id": call_id, "content": "{\"temperature\": 21}"})]);
    let (status, v) = server.chat(&body).await;
    assert_eq!(status, 200, "{v}");

    // Bad requests name their field.
    let user = json!({"role": "user", "content": "hi"});
    let bad_call = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]});
    for (extra, param) in [
        (json!({"messages": [user, {"role": "tool", "content": "21"}]}), "messages"),
        (json!({"messages": [user, bad_call]}), "messages"),
        (json!({"messages": [user, {"role": "user", "content": "x", "tool_calls": []}]}), "messages"),
        (json!({"tool_choice": {"type": "function", "function": {"name": "nowhere"}}}), "tool_choice"),
        (json!({"tool_choice": "required", "response_format": {"type": "json_object"}}), "tool_choice"),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (json!({"tools": [{"type": "retrieval"}], "tool_choice": "required"}), "tools"),
        (json!({"tools": [], "tool_choice": "required"}), "tools"),
        (json!({"tools": null, "tool_choice": "required"}), "tool_choice"),
    ] {
        let mut body = request(json!({"tool_choice": "required"}));
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        if body["tools"].is_null() {
            body.as_object_mut().unwrap().remove("tools");
        }
        let (status, v) = server.chat(&body).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{extra}: {v}");
    }
    let r = server
        .http
        .post(format!("{}/v1/completions", server.url))
        .json(&json!({"prompt": "hi", "tools": tools(), "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(server.metric_becomes("mmserve_embed_cache_references", 0).await, 0);
    server.stop();
}

/// `"auto"` with the model's own format: a Hermes template renders the tools, calls and
/// tool answers, and a `<tool_call>` block in the output becomes `tool_calls`.
#[tokio::test]
async fn auto_reads_hermes_tool_calls_and_the_template_renders_tools() {
    let model = repo().join("assets/models/qwen2.5-vl-tiny");
    let template = repo().join("tests/data/hermes_tools.jinja");
    let server = Server::start_model(&model, &["--chat-template", template.to_str().unwrap()]);
    let user = json!({"role": "user", "content": "Weather in Paris?"});
    let call = json!({"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}});
    let history = json!([user, {"role": "assistant", "content": null, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]);
    let r = server
        .http
        .post(format!("{}/tokenize", server.url))
        .json(&json!({"messages": history, "tools": tools(), "return_token_strs": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let text: String = v["token_strs"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect::<String>();
    // Byte-level BPE writes a space as Ġ and a newline as Ċ.
    let text = text.replace('Ġ', " ").replace('Ċ', "\n");
    for want in [
        // The tools as Python's json.dumps writes them, in the client's key order.
        r#"{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters""#,
        // The call's arguments as an object, and the tool's answer.
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>",
        "<tool_response>\n21 degrees\n</tool_response>",
    ] {
        assert!(text.contains(want), "{want:?} not in {text:?}");
    }

    // The model's own call, forced by a regex (the tiny model's free text is gibberish).
    let forced = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";
    let regex = regex_escape(forced);
    let body = json!({"messages": [user], "tools": tools(), "max_tokens": 120, "temperature": 0,
                      "structured_outputs": {"regex": regex}});
    let (status, v) = server.chat(&body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "Let me check.", "{v}");
    let c = calls(&v);
    assert_eq!(c.len(), 1, "{v}");
    assert_eq!(c[0].0, "get_weather");
    assert_eq!(serde_json::from_str::<Value>(&c[0].1).unwrap(), json!({"city": "Paris", "unit": "celsius"}));
    let (s_calls, s_content, s_finish) = streamed(&server, &body).await;
    assert_eq!((s_calls, s_content.as_str(), s_finish.as_str()), (c, "Let me check.", "tool_calls"));
    // Without tools the same text is content.
    let mut plain = body.clone();
    plain.as_object_mut().unwrap().remove("tools");
    let (_, v) = server.chat(&plain).await;
    assert_eq!(v["choices"][0]["message"]["content"], forced, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    server.stop();
}

/// A regex matching exactly `s`.
fn regex_escape(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            '\n' => "\\n".to_string(),
            c if "\\.+*?()|[]{}^$".contains(c) => format!("\\{c}"),
            c => c.to_string(),
        })
        .collect()
}
