//! The trained default models answer a fixed set of held-out questions through the real
//! server (`tests/data/accuracy`, made by `tools/train/eval_server.py --export`): a
//! preprocessing, resampling or merging bug that the random-weight parity tests cannot see
//! makes a trained model wrong, and this test fails. The thresholds sit a little under the
//! accuracy measured on these items when the set was made.

mod common;

use std::path::PathBuf;

use common::*;
use serde_json::{Value, json};

fn set_dir() -> PathBuf {
    repo().join("tests/data/accuracy")
}

/// The content part for one file of the set, by its extension.
fn part(name: &str) -> Value {
    let bytes = std::fs::read(set_dir().join(name)).unwrap();
    let ext = name.rsplit('.').next().unwrap();
    match ext {
        "png" | "jpeg" => {
            json!({"type": "image_url", "image_url": {"url": format!("data:image/{ext};base64,{}", b64(&bytes))}})
        }
        "wav" | "flac" | "mp3" => json!({"type": "input_audio", "input_audio": {"data": b64(&bytes), "format": ext}}),
        other => panic!("unexpected file type {other}"),
    }
}

/// Exact matches of `model`'s items of the set, and how many there are.
async fn score(server: &Server, model: &str) -> (usize, usize, Vec<String>) {
    let expected: Vec<Value> =
        serde_json::from_slice(&std::fs::read(set_dir().join("expected.json")).unwrap()).unwrap();
    let (mut right, mut total, mut misses) = (0, 0, Vec::new());
    for item in expected.iter().filter(|i| i["model"] == model) {
        let mut content: Vec<Value> =
            item["files"].as_array().unwrap().iter().map(|f| part(f.as_str().unwrap())).collect();
        content.push(json!({"type": "text", "text": item["question"]}));
        let body = json!({
            "model": "default",
            "messages": [{"role": "user", "content": content}],
            // Room for the longest answer (a four-shape description is about 30 tokens).
            "max_tokens": 48,
            "temperature": 0,
        });
        let (status, reply) = server.chat(&body).await;
        assert_eq!(status, 200, "{reply}");
        let got = reply["choices"][0]["message"]["content"].as_str().unwrap().trim().to_string();
        total += 1;
        if got == item["answer"] {
            right += 1;
        } else {
            misses.push(format!("{}: {} -> {got:?} (want {})", item["files"], item["question"], item["answer"]));
        }
    }
    (right, total, misses)
}

#[tokio::test]
async fn the_audio_model_answers_held_out_clips() {
    // Measured 10/10 on this set (and 96.5% on 200 held-out clips) when it was made.
    let server =
        Server::start_model(&repo().join("assets/models/qwen2-audio-clips"), &["--served-model-name", "default"]);
    let (right, total, misses) = score(&server, "audio").await;
    assert_eq!(total, 10);
    assert!(right >= 9, "{right}/{total} right: {misses:#?}");
    server.stop();
}
