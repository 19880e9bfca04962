//! Qwen2-Audio through `mmserve serve`: the fixture's clip as `input_audio` gives
//! transformers' greedy tokens, in other containers too; several clips per message;
//! repeated clips hit the embed cache; bad audio is a 400 that leaves nothing behind;
//! a model takes only its own modality.

mod common;

use std::path::PathBuf;

use common::*;
use serde_json::{Value, json};

fn audio_dir() -> PathBuf {
    repo().join("assets/models/qwen2-audio-tiny")
}

/// Audio files of the media crate's tests: the fixture's chirp in other containers.
fn media_file(name: &str) -> Vec<u8> {
    std::fs::read(repo().join("crates/media/tests/data/audio").join(name)).unwrap()
}

fn input_audio(bytes: &[u8], format: &str) -> Value {
    json!({"type": "input_audio", "input_audio": {"data": b64(bytes), "format": format}})
}

fn request(parts: Vec<Value>) -> Value {
    let mut content = parts;
    content.push(json!({"type": "text", "text": "What is that sound?"}));
    json!({
        "model": "qwen2-audio-tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": true,
        "return_token_ids": true,
    })
}

fn wav() -> Vec<u8> {
    std::fs::read(audio_dir().join("input.wav")).unwrap()
}

fn reference_tokens() -> Vec<u64> {
    let r: Value = serde_json::from_str(&std::fs::read_to_string(audio_dir().join("reference.json")).unwrap()).unwrap();
    ids(&r["generated_ids"])
}

#[tokio::test]
async fn the_fixture_clip_gives_transformers_tokens_in_every_container() {
    let server = Server::start_model(&audio_dir(), &[]);
    let want = reference_tokens();
    let (status, body) = server.chat(&request(vec![input_audio(&wav(), "wav")])).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(ids(&body["choices"][0]["token_ids"]), want);
    assert_eq!(body["usage"]["prompt_tokens_details"]["audio_tokens"], 34);
    assert_eq!(body["usage"]["prompt_tokens"], 81);
    let r: Value = serde_json::from_str(&std::fs::read_to_string(audio_dir().join("reference.json")).unwrap()).unwrap();
    // The prompt as transformers expands it, with the 34 placeholders as our virtual ids.
    let prompt = ids(&body["prompt_token_ids"]);
    let expected = ids(&r["input_ids"]);
    assert_eq!(prompt.len(), expected.len());
    for (p, e) in prompt.iter().zip(&expected) {
        assert!(if *e == 2014 { *p >= 1 << 32 } else { p == e }, "{p} for {e}");
    }

    // 16-bit FLAC of the same clip: the same tokens; also as an `audio_url` data URL.
    let flac = media_file("pcm16.flac");
    let (status, body) = server.chat(&request(vec![input_audio(&flac, "flac")])).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(ids(&body["choices"][0]["token_ids"]), want, "FLAC");
    let url = format!("data:audio/flac;base64,{}", b64(&flac));
    let (status, body) = server.chat(&request(vec![json!({"type": "audio_url", "audio_url": {"url": url}})])).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(ids(&body["choices"][0]["token_ids"]), want, "FLAC by audio_url");
    // MP3 (lossy) and Ogg Vorbis are accepted.
    for (name, format) in [("chirp.mp3", "mp3"), ("chirp.ogg", "ogg")] {
        let (status, body) = server.chat(&request(vec![input_audio(&media_file(name), format)])).await;
        assert_eq!(status, 200, "{name}: {body}");
        assert_eq!(ids(&body["choices"][0]["token_ids"]).len(), 8, "{name}");
    }
    server.stop();
}

#[tokio::test]
async fn several_clips_per_message_and_repeats_hit_the_cache() {
    let server = Server::start_model(&audio_dir(), &[]);
    let two = request(vec![input_audio(&wav(), "wav"), input_audio(&media_file("pcm16_44k1.wav"), "wav")]);
    let (status, body) = server.chat(&two).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens_details"]["audio_tokens"], 68);
    let text = serde_json::to_string(&body["prompt_token_ids"]).unwrap();
    assert_eq!(ids(&body["prompt_token_ids"]).iter().filter(|&&id| id >= 1 << 32).count(), 68, "{text}");
    let encoded = server.metric("mmserve_encoder_items_total").await;
    let hits = server.metric("mmserve_embed_cache_hits_total").await;
    assert_eq!(encoded, 2);

    // The same two again, and the first alone: all cache hits, nothing encoded.
    let (status, again) = server.chat(&two).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["choices"][0]["token_ids"], body["choices"][0]["token_ids"]);
    let (status, one) = server.chat(&request(vec![input_audio(&wav(), "wav")])).await;
    assert_eq!(status, 200, "{one}");
    assert_eq!(ids(&one["choices"][0]["token_ids"]), reference_tokens());
    assert_eq!(server.metric("mmserve_encoder_items_total").await, encoded, "a repeated clip was encoded again");
    assert_eq!(server.metric("mmserve_embed_cache_hits_total").await, hits + 3);
    assert_eq!(server.metric_becomes("mmserve_embed_cache_references", 0).await, 0);
    server.stop();
}

/// A WAV header: PCM16 mono 16 kHz whose data chunk claims `data_len` bytes.
fn wav_header(data_len: u32) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(b"RIFF");
    h.extend_from_slice(&data_len.saturating_add(36).to_le_bytes());
    h.extend_from_slice(b"WAVEfmt ");
    h.extend_from_slice(&16u32.to_le_bytes());
    h.extend_from_slice(&1u16.to_le_bytes()); // PCM
    h.extend_from_slice(&1u16.to_le_bytes()); // mono
    h.extend_from_slice(&16_000u32.to_le_bytes());
    h.extend_from_slice(&32_000u32.to_le_bytes());
    h.extend_from_slice(&2u16.to_le_bytes());
    h.extend_from_slice(&16u16.to_le_bytes());
    h.extend_from_slice(b"data");
    h.extend_from_slice(&data_len.to_le_bytes());
    h
}

#[tokio::test]
async fn bad_audio_is_a_400_that_leaves_nothing_behind() {
    let server = Server::start_model(&audio_dir(), &["--max-audio-seconds=60"]);
    let wav = wav();
    let mut hours = wav_header(u32::MAX - 64);
    hours.extend_from_slice(&[0u8; 3200]);
    let cases: Vec<(&str, Value, &str)> = vec![
        ("truncated", input_audio(&wav[..60], "wav"), "truncated"),
        ("zero-length", input_audio(&[], "wav"), "empty"),
        ("a header that claims hours", input_audio(&hours, "wav"), "limit of 60 s (--max-audio-seconds)"),
        ("an unsupported codec", input_audio(&media_file("chirp.opus"), "ogg"), "Opus"),
        (
            "garbage",
            input_audio(b"this is not audio at all, just some text bytes", "mp3"),
            "not a recognised audio format",
        ),
        ("not base64", json!({"type": "input_audio", "input_audio": {"data": "@@@", "format": "wav"}}), "base64"),
        ("no data", json!({"type": "input_audio", "input_audio": {"format": "wav"}}), "data"),
        ("too short", input_audio(&wav_pcm16(&[0; 100]), "wav"), "short"),
    ];
    for (what, part, needle) in cases {
        let (status, body) = server.chat(&request(vec![part])).await;
        assert_eq!(status, 400, "{what}: {body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{what}: {message}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{what}");
    }
    assert_eq!(server.metric("mmserve_embed_cache_items").await, 0, "a bad clip reached the cache");
    assert_eq!(server.metric("mmserve_embed_cache_references").await, 0);
    // An image sent to an audio model names what the model takes.
    let png = fixture_png();
    let (status, body) =
        server.chat(&request(vec![json!({"type": "image_url", "image_url": {"url": data_url(&png)}})])).await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("accepts text and audio, not images"), "{message}");
    // Still serving.
    let (status, body) = server.chat(&request(vec![input_audio(&wav, "wav")])).await;
    assert_eq!(status, 200, "{body}");
    server.stop();
}

/// A PCM16 mono 16 kHz WAV of `samples`.
fn wav_pcm16(samples: &[i16]) -> Vec<u8> {
    let mut w = wav_header(2 * samples.len() as u32);
    w.extend(samples.iter().flat_map(|s| s.to_le_bytes()));
    w
}

#[tokio::test]
async fn an_image_model_refuses_audio_naming_its_modalities() {
    let server = Server::start(&[]);
    let mut body = request(vec![input_audio(&wav(), "wav")]);
    body["model"] = json!("llava-tiny");
    let (status, body) = server.chat(&body).await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("accepts text and images, not audio"), "{message}");
    server.stop();
}
