//! The endpoints besides chat that vLLM users script against: `/v1/completions` (plain
//! and streamed, prompts as text or ids, legacy logprobs), `/tokenize` (a prompt, or chat
//! messages with media counted as the server counts them), `/detokenize`,
//! `/v1/models/{id}` and `/version`.

mod common;

use common::*;
use serde_json::{Value, json};

async fn post(server: &Server, path: &str, body: &Value) -> (u16, Value) {
    let r = server.http.post(format!("{}{path}", server.url)).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

#[tokio::test]
async fn completions_take_text_or_ids_and_answer_in_the_legacy_shape() {
    let server = Server::start(&[]);
    let req = |prompt: Value| {
        json!({"model": "llava-tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": true,
               "logprobs": 2, "return_token_ids": true})
    };
    let (status, text) = post(&server, "/v1/completions", &req(json!("Hello there"))).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text["object"], "text_completion");
    assert!(text["id"].as_str().unwrap().starts_with("cmpl-"), "{text}");
    let choice = &text["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(text["usage"]["completion_tokens"], 5);
    let lp = &choice["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 5, "{lp}");
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 5);
    assert!(lp["top_logprobs"][0].as_object().unwrap().len() <= 2, "{lp}");
    let offsets: Vec<u64> = lp["text_offset"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");

    // The same prompt as ids (from /tokenize): the same tokens.
    let (status, tok) = post(&server, "/tokenize", &json!({"model": "llava-tiny", "prompt": "Hello there"})).await;
    assert_eq!(status, 200, "{tok}");
    assert_eq!(tok["count"], text["usage"]["prompt_tokens"]);
    let (_, by_ids) = post(&server, "/v1/completions", &req(tok["tokens"].clone())).await;
    assert_eq!(by_ids["choices"][0]["token_ids"], choice["token_ids"]);
    let (_, listed) = post(&server, "/v1/completions", &req(json!(["Hello there"]))).await;
    assert_eq!(listed["choices"][0]["text"], choice["text"]);

    // Streamed: the same text, text_completion chunks, usage at the end.
    let mut streamed = req(json!("Hello there"));
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = server.http.post(format!("{}/v1/completions", server.url)).json(&streamed).send().await.unwrap();
    let body = r.text().await.unwrap();
    let frames: Vec<&str> = body.split("\n\n").filter_map(|f| f.strip_prefix("data: ")).collect();
    assert_eq!(frames.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = frames[..frames.len() - 1].iter().map(|f| serde_json::from_str(f).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"), "{chunks:?}");
    let text_streamed: String =
        chunks.iter().filter_map(|c| c["choices"].get(0).and_then(|ch| ch["text"].as_str())).collect();
    assert_eq!(text_streamed, choice["text"].as_str().unwrap());
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 5);

    // OpenAI's default of 16 tokens; refusals by name.
    let (_, default) = post(&server, "/v1/completions", &json!({"prompt": "Hi", "ignore_eos": true})).await;
    assert_eq!(default["usage"]["completion_tokens"], 16, "{default}");
    for (body, param) in [
        (json!({"prompt": "Hi", "echo": true}), "echo"),
        (json!({"prompt": "Hi", "suffix": "end"}), "suffix"),
        (json!({"prompt": ["a", "b"]}), "prompt"),
        (json!({"prompt": "Hi", "best_of": 3}), "best_of"),
        (json!({"prompt": "Hi", "logprobs": 99}), "logprobs"),
        (json!({"prompt": [99999999]}), "prompt"),
        (json!({"messages": []}), "prompt"),
    ] {
        let (status, v) = post(&server, "/v1/completions", &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    server.stop();
}

#[tokio::test]
async fn tokenize_counts_media_as_chat_does_and_detokenize_inverts_it() {
    let server = Server::start(&[]);
    let url = data_url(&fixture_png());
    let chat = image_request(&url, false);
    let (_, answer) = server.chat(&chat).await;
    let (status, tok) = post(
        &server,
        "/tokenize",
        &json!({"model": "llava-tiny", "messages": chat["messages"], "return_token_strs": true}),
    )
    .await;
    assert_eq!(status, 200, "{tok}");
    assert_eq!(tok["count"], answer["usage"]["prompt_tokens"], "{tok}");
    assert_eq!(tok["count"], 45);
    assert_eq!(tok["token_strs"].as_array().unwrap().len(), 45);
    assert_eq!(tok["max_model_len"], answer_max_len(&server).await);

    let (_, with) = post(&server, "/tokenize", &json!({"prompt": "a cat on a mat"})).await;
    let (_, without) =
        post(&server, "/tokenize", &json!({"prompt": "a cat on a mat", "add_special_tokens": false})).await;
    assert_eq!(with["count"].as_u64().unwrap(), without["count"].as_u64().unwrap() + 1, "BOS");
    let (status, back) = post(&server, "/detokenize", &json!({"tokens": without["tokens"]})).await;
    assert_eq!(status, 200, "{back}");
    assert_eq!(back["prompt"], "a cat on a mat");

    for (path, body, param) in [
        ("/tokenize", json!({"prompt": "x", "messages": []}), Value::Null),
        ("/tokenize", json!({"prompt": "x", "truncate": 3}), json!("truncate")),
        ("/detokenize", json!({"tokens": [99999999]}), json!("tokens")),
    ] {
        let (status, v) = post(&server, path, &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    let (status, v) = post(&server, "/tokenize", &json!({"model": "other", "prompt": "x"})).await;
    assert_eq!((status, v["error"]["code"].clone()), (404, json!("model_not_found")));
    server.stop();
}

async fn answer_max_len(server: &Server) -> Value {
    let v: Value =
        server.http.get(format!("{}/v1/models/llava-tiny", server.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["id"], "llava-tiny", "{v}");
    assert_eq!(v["object"], "model");
    let r = server.http.get(format!("{}/v1/models/nope", server.url)).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "model_not_found");
    let version: Value = server.http.get(format!("{}/version", server.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(version["version"], env!("CARGO_PKG_VERSION"));
    v["max_model_len"].clone()
}

/// `--max-model-len` caps the context; a prompt past it is cut at the start
/// (`--long-truncation-mode head`) to leave `max_tokens`, or to the request's
/// `truncate_prompt_tokens`; an image wholly in the cut part goes, a cut inside one is
/// refused.
#[tokio::test]
async fn long_prompts_are_cut_without_splitting_an_image() {
    let server = Server::start(&["--max-model-len", "60", "--long-truncation-mode", "head"]);
    let v: Value = server.http.get(format!("{}/v1/models", server.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["data"][0]["max_model_len"], 60);
    let long = "the cat sat on the mat and looked at the dog ".repeat(20);
    let text = |extra: Value| {
        let mut body = json!({"model": "llava-tiny", "messages": [{"role": "user", "content": long}], "max_tokens": 8,
                              "ignore_eos": true});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let (status, v) = server.chat(&text(json!({}))).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() <= 52, "{v}");
    let (status, v) = server.chat(&text(json!({"truncate_prompt_tokens": 20}))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 20, "{v}");
    let (status, v) = server.chat(&text(json!({"max_tokens": 100}))).await;
    assert_eq!(status, 400, "more output than the context holds: {v}");

    // The fixture's image request: 45 tokens, the image's 16 near the start.
    let image = |k: u64| {
        let mut body = image_request(&data_url(&fixture_png()), false);
        body["truncate_prompt_tokens"] = k.into();
        body
    };
    let (status, v) = server.chat(&image(30)).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "truncate_prompt_tokens", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("split media item 0"), "{v}");
    let (status, v) = server.chat(&image(20)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 20, "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["image_tokens"], 0, "{v}");
    let (status, v) = server.chat(&image(45)).await;
    assert_eq!((status, v["usage"]["prompt_tokens_details"]["image_tokens"].clone()), (200, json!(16)), "{v}");
    assert_eq!(server.metric_becomes("mmserve_embed_cache_references", 0).await, 0, "nothing held after the cuts");
    server.stop();
}

/// `--served-model-name` with several names (responses carry the first), `--chat-template`
/// from a file, and `--model` as a hub id found in the local Hugging Face cache (and a
/// clear error that says where it looked when it is not there).
#[tokio::test]
async fn names_templates_and_hub_ids() {
    let root = std::env::temp_dir().join(format!("mmserve-hub-e2e-{}", std::process::id()));
    let snapshot = root.join("models--acme--tiny-llava/snapshots/0123abc");
    std::fs::create_dir_all(&snapshot).unwrap();
    for entry in std::fs::read_dir(llava_dir()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), snapshot.join(entry.file_name())).unwrap();
    }
    std::fs::create_dir_all(root.join("models--acme--tiny-llava/refs")).unwrap();
    std::fs::write(root.join("models--acme--tiny-llava/refs/main"), "0123abc").unwrap();
    let template = root.join("template.jinja");
    std::fs::write(&template, "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}ASSISTANT:").unwrap();
    let cache = root.to_str().unwrap();

    let server = Server::start_with(
        std::path::Path::new("acme/tiny-llava"),
        &["--served-model-name", "first,second", "--chat-template", template.to_str().unwrap()],
        &[("MMSERVE_LOG", "warn"), ("HF_HUB_CACHE", cache)],
        std::process::Stdio::inherit(),
    );
    let v: Value = server.http.get(format!("{}/v1/models", server.url)).send().await.unwrap().json().await.unwrap();
    let ids: Vec<&str> = v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["first", "second"]);
    let chat = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let (status, v) = server.chat(&chat("second")).await;
    assert_eq!((status, v["model"].clone()), (200, json!("first")), "{v}");
    let (status, _) = server.chat(&chat("acme/tiny-llava")).await;
    assert_eq!(status, 404, "not a served name once names are given");
    let (_, tok) = post(&server, "/tokenize", &json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    let (_, text) = post(&server, "/detokenize", &json!({"tokens": tok["tokens"]})).await;
    assert!(
        text["prompt"].as_str().unwrap().contains("[user] ")
            && text["prompt"].as_str().unwrap().ends_with("ASSISTANT:"),
        "{text}"
    );
    server.stop();

    // Not in the cache: serve fails at start, saying where it looked.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .args(["serve", "--port", "0", "--model", "acme/absent"])
        .env("HF_HUB_CACHE", cache)
        .env("MMSERVE_LOG", "warn")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("models--acme--absent"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}
