//! Qwen2-VL and Qwen2.5-VL through `mmserve serve`: the fixture's image at its dynamic
//! resolution (12 tokens), its prompt at M-RoPE positions computed by the api, gives
//! transformers' prompt and greedy tokens, streamed and not; a repeated image hits the
//! embed cache and the prefix cache and gives the same tokens.

mod common;

use common::*;
use serde_json::Value;

/// The fixture's question (common's `image_request`) addressed to `model`.
fn request(model: &str, url: &str, stream: bool) -> Value {
    let mut body = image_request(url, stream);
    body["model"] = model.into();
    body
}

#[tokio::test]
async fn greedy_tokens_match_transformers_for_both_qwen_vl_models() {
    for name in ["qwen2-vl-tiny", "qwen2.5-vl-tiny"] {
        let dir = repo().join("assets/models").join(name);
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        let png = std::fs::read(dir.join("input.png")).unwrap();
        let server = Server::start_model(&dir, &[]);
        let (status, body) = server.chat(&request(name, &data_url(&png), false)).await;
        assert_eq!(status, 200, "{name}: {body}");
        let prompt = ids(&body["prompt_token_ids"]);
        assert_eq!(prompt.len(), ids(&reference["input_ids"]).len(), "{name}: 12 image tokens and the text");
        assert_eq!(ids(&body["choices"][0]["token_ids"]), ids(&reference["generated_ids"]), "{name}");
        assert_eq!(body["usage"]["prompt_tokens_details"]["image_tokens"], 12, "{name}: {body}");
        assert_eq!(body["usage"]["prompt_tokens"], prompt.len(), "{name}");
        // Again: the embed cache and the prefix cache serve it, the same tokens come.
        let (_, again) = server.chat(&request(name, &data_url(&png), false)).await;
        assert_eq!(ids(&again["choices"][0]["token_ids"]), ids(&reference["generated_ids"]), "{name}: hit");
        assert!(server.metric("mmserve_embed_cache_hits_total").await >= 1);
        // Bad images are a 400: an aspect ratio past 200 (transformers refuses it), and
        // a tiny one is scaled up to min_pixels rather than refused.
        let thin = png_of(300, 1);
        let (status, body) = server.chat(&request(name, &data_url(&thin), false)).await;
        assert_eq!(status, 400, "{name}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains("200"), "{body}");
        let (status, body) = server.chat(&request(name, &data_url(&png_of(3, 3)), false)).await;
        assert_eq!(status, 200, "{name}: {body}");
        server.stop();
    }
}

/// vLLM's `mm_processor_kwargs`: a request's own pixel bounds change its image's token
/// count (the encoder resizes within them too, or its rows would not match the count),
/// never reuse an embedding made under other bounds, and are refused outside the server's
/// limit, for keys the processor does not take, in the wrong order, and where the image
/// would outgrow the context.
#[tokio::test]
async fn mm_processor_kwargs_set_an_images_resolution_within_the_servers_limits() {
    let name = "qwen2-vl-tiny";
    let dir = repo().join("assets/models").join(name);
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let url = data_url(&std::fs::read(dir.join("input.png")).unwrap());
    let server = Server::start_model(&dir, &["--mm-max-pixels", "4000000"]);
    let with = |kwargs: Value| {
        let mut body = request(name, &url, false);
        body["mm_processor_kwargs"] = kwargs;
        body
    };
    let image_tokens = |body: &Value| body["usage"]["prompt_tokens_details"]["image_tokens"].as_u64().unwrap();
    let (status, small) = server.chat(&with(serde_json::json!({"max_pixels": 3136}))).await;
    assert_eq!(status, 200, "{small}");
    assert!((1..12).contains(&image_tokens(&small)), "{small}");
    let (status, large) = server.chat(&with(serde_json::json!({"min_pixels": 100_000}))).await;
    assert_eq!(status, 200, "{large}");
    assert!(image_tokens(&large) > 12, "{large}");
    // The config's bounds again: transformers' tokens, not an embedding made above.
    let (status, plain) = server.chat(&with(serde_json::json!({}))).await;
    assert_eq!(status, 200, "{plain}");
    assert_eq!(image_tokens(&plain), 12);
    assert_eq!(ids(&plain["choices"][0]["token_ids"]), ids(&reference["generated_ids"]));
    for (kwargs, names) in [
        (serde_json::json!({"max_pixels": 5_000_000}), "--mm-max-pixels"),
        // About 5,100 image tokens: more than the model's context of 4,096.
        (serde_json::json!({"min_pixels": 4_000_000, "max_pixels": 4_000_000}), "context"),
        (serde_json::json!({"size": {"shortest_edge": 4}}), "mm_processor_kwargs.size"),
        (serde_json::json!({"min_pixels": 50_000, "max_pixels": 40_000}), "min_pixels"),
        (serde_json::json!({"min_pixels": -1}), "positive integer"),
    ] {
        let (status, body) = server.chat(&with(kwargs.clone())).await;
        assert_eq!(status, 400, "{kwargs}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains(names), "{kwargs}: {body}");
    }
    server.stop();
}

fn png_of(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 3) as u8, (y * 5) as u8, 7]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}
