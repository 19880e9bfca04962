//! The engine's paged KV cache through `mmserve serve`: greedy tokens do not depend on
//! batching, chunking, prefix-cache hits or preemption.

mod common;

use common::*;
use serde_json::{Value, json};

fn text_request(i: usize, max_tokens: u32) -> Value {
    let words = ["apples", "rivers", "the moon", "seven cats", "a red door", "winter", "clocks", "bread"];
    let content = format!("Tell me about {} number {i}, please.", words[i % words.len()]).repeat(1 + i % 3);
    json!({
        "model": "llava-tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "return_token_ids": true,
    })
}

async fn token_ids(server: &Server, body: &Value) -> Vec<u64> {
    let (status, body) = server.chat(body).await;
    assert_eq!(status, 200, "{body}");
    ids(&body["choices"][0]["token_ids"])
}

/// Each request alone, one after another.
async fn alone(server: &Server, reqs: &[Value]) -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    for r in reqs {
        out.push(token_ids(server, r).await);
    }
    out
}

/// All requests at once.
async fn together(server: &Server, reqs: &[Value]) -> Vec<Vec<u64>> {
    futures::future::join_all(reqs.iter().map(|r| token_ids(server, r))).await
}

#[tokio::test]
async fn greedy_tokens_do_not_depend_on_batching_or_chunking() {
    let reqs: Vec<Value> = (0..16).map(|i| text_request(i, 12)).collect();
    let server = Server::start(&["--no-prefix-cache"]);
    let want = alone(&server, &reqs).await;
    assert_eq!(server.metric("mmserve_prefix_cache_hit_tokens_total").await, 0);
    server.stop();

    // Small blocks, small chunks: prefills split and mix with decodes of the others.
    let server = Server::start(&["--block-size=4", "--chunked-prefill-size=7"]);
    let got = together(&server, &reqs).await;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i} among 16 others");
    }
    assert!(server.metric("mmserve_kv_blocks_total").await > 0);
    assert_eq!(server.metric_becomes("mmserve_kv_blocks_used", 0).await, 0);
    server.stop();
}

#[tokio::test]
async fn a_prefix_cache_hit_gives_the_same_tokens() {
    let want = ids(&reference()["generated_ids"]);
    let server = Server::start(&["--block-size=4"]);
    let url = data_url(&fixture_png());
    let req = image_request(&url, false);
    assert_eq!(token_ids(&server, &req).await, want);
    let first = server.metric("mmserve_prefix_cache_hit_tokens_total").await;
    assert_eq!(token_ids(&server, &req).await, want);
    let second = server.metric("mmserve_prefix_cache_hit_tokens_total").await;
    assert!(second > first, "prefix cache hit tokens {first} → {second}");
    // Chunked through the image's rows: still the same tokens.
    server.stop();
    let server = Server::start(&["--chunked-prefill-size=5", "--no-prefix-cache"]);
    assert_eq!(token_ids(&server, &req).await, want);
    server.stop();
}

#[tokio::test]
async fn preemption_completes_every_request_with_the_same_tokens() {
    // 64 output tokens: each request fits the pool alone and any two whose decodes overlap
    // do not, so preemption does not depend on the eight arriving within milliseconds of
    // each other (with 24, a loaded machine once ran them one by one).
    let reqs: Vec<Value> = (0..8).map(|i| text_request(i, 64)).collect();
    let server = Server::start(&["--no-prefix-cache"]);
    let want = alone(&server, &reqs).await;
    server.stop();

    // 40 blocks of 4 tokens; admission assumes 1 output token, so the pool runs out.
    let server = Server::start(&["--block-size=4", "--kv-cache-memory=81920", "--expected-output-tokens=1"]);
    assert_eq!(server.metric("mmserve_kv_blocks_total").await, 40);
    let got = together(&server, &reqs).await;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i} with preemption");
    }
    assert!(server.metric("mmserve_num_preemptions_total").await > 0, "nothing was preempted");
    assert_eq!(server.metric_becomes("mmserve_kv_blocks_used", 0).await, 0);
    // A request that can never fit the pool is refused, not queued forever.
    let (status, body) = server.chat(&text_request(0, 400)).await;
    assert_eq!(status, 400, "{body}");
    server.stop();
}

#[tokio::test]
async fn n_choices_share_one_prefill_of_the_prompt() {
    let server = Server::start(&[]);
    let mut body = text_request(3, 6);
    body["n"] = json!(3);
    body["temperature"] = json!(0.8);
    body["seed"] = json!(11);
    let (status, resp) = server.chat(&body).await;
    assert_eq!(status, 200, "{resp}");
    let choices = resp["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let prompt = resp["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(server.metric("mmserve_forks_total").await, 2, "choices 1 and 2 fork choice 0");
    assert_eq!(server.metric("mmserve_prefill_tokens_total").await, prompt, "the prompt is computed once");
    // Choice i with seed s samples as a request with seed s + i does alone.
    for (i, choice) in choices.iter().enumerate() {
        let mut alone = text_request(3, 6);
        alone["temperature"] = json!(0.8);
        alone["seed"] = json!(11 + i);
        assert_eq!(ids(&choice["token_ids"]), token_ids(&server, &alone).await, "choice {i}");
    }
    assert_eq!(server.metric_becomes("mmserve_kv_blocks_used", 0).await, 0);
    server.stop();
}
