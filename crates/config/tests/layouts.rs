//! The Hub layout and transformers v5's layout of the same config parse alike.

use mmserve_config::{FeatureSelect, ModelConfig};
use serde_json::Value;

fn load(v: &Value) -> mmserve_config::LlavaConfig {
    match ModelConfig::from_json(v).unwrap() {
        ModelConfig::Llava(c) => c,
        other => panic!("not LLaVA: {other:?}"),
    }
}

#[test]
fn qwen2_audio_hub_and_v5_layouts_agree() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/models/qwen2-audio-tiny");
    let read = |name: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(format!("{dir}/{name}")).unwrap()).unwrap()
    };
    let reference = read("reference.json");
    let load = |v: &Value| match ModelConfig::from_json(v).unwrap() {
        ModelConfig::Qwen2Audio(c) => c,
        other => panic!("not Qwen2-Audio: {other:?}"),
    };
    let (a, b) = (load(&read("config.json")), load(&reference["transformers_v5_save_pretrained"]["config.json"]));
    assert_eq!(a, b);
    assert_eq!((a.audio.d_model, a.audio.encoder_layers, a.audio.num_mel_bins), (32, 2, 128));
    assert_eq!((a.text.hidden_size, a.text.vocab_size, a.text.rms_norm_eps), (64, 2048, 1e-5));
    assert!(a.text.attention_bias && !a.text.o_proj_bias && !a.text.tie_word_embeddings);
    assert_eq!(a.audio_token_index, 2014);
}

#[test]
fn hub_and_v5_layouts_agree() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/models/llava-tiny");
    let hub: Value = serde_json::from_str(&std::fs::read_to_string(format!("{dir}/config.json")).unwrap()).unwrap();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{dir}/reference.json")).unwrap()).unwrap();
    let v5 = &reference["transformers_v5_save_pretrained"]["config.json"];
    assert!(v5["text_config"].get("rope_parameters").is_some() && v5.get("dtype").is_some());
    let (a, b) = (load(&hub), load(v5));
    assert_eq!(a, b);
    assert_eq!(a.text.rope_theta, 10000.0);
    assert_eq!(a.text.head_dim, 16);
    assert_eq!(a.feature_hidden_state_index(), 1);
    assert_eq!(a.vision_feature_select_strategy, FeatureSelect::Default);
    assert_eq!(a.image_token_count(), 16);
    assert_eq!(a.dtype, "float32");
}

#[test]
fn defaults_fill_a_sparse_hub_config() {
    // llava-1.5-7b-hf's config names few fields; the rest are transformers' defaults.
    let sparse: Value = serde_json::json!({
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": 32000,
        "text_config": {"model_type": "llama", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                        "torch_dtype": "float16", "vocab_size": 32064},
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768},
        "eos_token_id": [2, 32000]
    });
    let c = load(&sparse);
    assert_eq!((c.text.hidden_size, c.text.num_hidden_layers, c.text.num_key_value_heads), (4096, 32, 32));
    assert_eq!(c.text.vocab_size, 32064);
    assert_eq!(c.image_token_count(), 576);
    assert_eq!(c.feature_hidden_state_index(), 23);
    assert_eq!(c.dtype, "float16");
}

#[test]
fn bad_configs_are_errors() {
    let bad = serde_json::json!({"model_type": "llava", "text_config": {"hidden_size": 10, "num_attention_heads": 3}});
    assert!(ModelConfig::from_json(&bad).is_err());
    let unknown = serde_json::json!({"model_type": "gpt2"});
    assert!(ModelConfig::from_json(&unknown).is_err());
    let layer = serde_json::json!({"model_type": "llava", "vision_feature_layer": -40});
    assert!(ModelConfig::from_json(&layer).is_err());
}
