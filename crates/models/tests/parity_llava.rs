//! Parity with transformers on the tiny LLaVA fixture (f32, CPU).

mod common;

use candle_core::{DType, Device, IndexOp};
use common::{Reference, argmax, assert_close, fixture_dir};
use mmserve_config::{ModelConfig, ModelDir};
use mmserve_models::{ClipVisionTower, Llama, LlavaVision, Placement, SeqInput, Weights, merge_image_embeddings};

const TOL: f32 = 1e-4;
const IMAGE_TOKEN: u32 = 1000;

#[test]
fn vision_tower_and_projector_match_transformers() {
    let r = Reference::load();
    let dir = ModelDir::open(fixture_dir()).unwrap();
    let ModelConfig::Llava(cfg) = &dir.config else { panic!("not a LLaVA config") };
    let pixels = r.tensor("pixel_values");

    let vision = LlavaVision::load(&dir, &Placement::cpu()).unwrap();
    assert_eq!(vision.image_size(), 56);
    assert_eq!(vision.tokens_per_image(), 16);
    // vision_feature_layer -2 of 2 layers: only layer 0 is needed.
    assert_eq!(vision.tower().num_layers(), 1);
    let states = vision.tower().hidden_states(&pixels, 1).unwrap();
    assert_close("encoder_layer_0_output", &states[1], &r.tensor("encoder_layer_0_output"), TOL);

    let weights = Weights::open(&dir.weight_files().unwrap(), &Device::Cpu, DType::F32).unwrap();
    let full = ClipVisionTower::load(&weights, &cfg.vision, 2).unwrap();
    let last = full.hidden_state(&pixels, 2).unwrap();
    assert_close("encoder_layer_1_output", &last, &r.tensor("encoder_layer_1_output"), TOL);

    let projected = vision.encode(&pixels).unwrap();
    assert_close("mm_projector_output", &projected, &r.tensor("mm_projector_output"), TOL);
}

#[test]
fn language_model_matches_transformers() {
    let r = Reference::load();
    let dir = ModelDir::open(fixture_dir()).unwrap();
    let vision = LlavaVision::load(&dir, &Placement::cpu()).unwrap();
    let llama = Llama::load(&dir, &Placement::cpu()).unwrap();
    let ids = r.ids("input_ids");
    assert_eq!(ids.iter().filter(|&&id| id == IMAGE_TOKEN).count(), 16);

    let image = vision.encode(&r.tensor("pixel_values")).unwrap();
    let embeds = merge_image_embeddings(&llama, &ids, IMAGE_TOKEN, &image).unwrap();
    let hidden_states = r.tensor("hidden_states");
    assert_close("merged input embeddings", &embeds, &hidden_states.i(0).unwrap(), TOL);

    let mut cache = llama.new_cache();
    let seq = SeqInput { new_tokens: ids.len(), cache: &mut cache };
    let hidden = llama.forward_hidden(&embeds, &mut [seq], true).unwrap();
    assert_close("final hidden states", &hidden, &hidden_states.i(2).unwrap(), TOL);

    let mut cache = llama.new_cache();
    let seq = SeqInput { new_tokens: ids.len(), cache: &mut cache };
    let logits = llama.forward(&embeds, &mut [seq], true).unwrap();
    assert_eq!(cache.len(), ids.len());
    assert_close("logits", &logits, &r.tensor("logits"), TOL);
    assert_close("logits_last", &logits.i(ids.len() - 1).unwrap(), &r.tensor("logits_last"), TOL);

    let text_ids = r.ids("text_only_input_ids");
    let mut cache = llama.new_cache();
    let seq = SeqInput { new_tokens: text_ids.len(), cache: &mut cache };
    let text_embeds = llama.embed_tokens(&text_ids).unwrap();
    let logits = llama.forward(&text_embeds, &mut [seq], true).unwrap();
    assert_close("text_only_logits", &logits, &r.tensor("text_only_logits"), TOL);
}

#[test]
fn greedy_generation_with_kv_cache_matches_transformers() {
    let r = Reference::load();
    let dir = ModelDir::open(fixture_dir()).unwrap();
    let vision = LlavaVision::load(&dir, &Placement::cpu()).unwrap();
    let llama = Llama::load(&dir, &Placement::cpu()).unwrap();
    let ids = r.ids("input_ids");
    let expected_ids = r.ids("generated_ids");
    let expected_logits = r.tensor("generate_logits");

    let image = vision.encode(&r.tensor("pixel_values")).unwrap();
    let mut embeds = merge_image_embeddings(&llama, &ids, IMAGE_TOKEN, &image).unwrap();
    let mut cache = llama.new_cache();
    let mut generated = Vec::new();
    let mut worst = 0f32;
    for step in 0..expected_ids.len() {
        let seq = SeqInput { new_tokens: embeds.dim(0).unwrap(), cache: &mut cache };
        let logits = llama.forward(&embeds, &mut [seq], false).unwrap();
        assert_eq!(logits.dims(), &[1, 1024]);
        let row = logits.i(0).unwrap();
        let what = format!("generate_logits[{step}]");
        worst = worst.max(assert_close(&what, &row, &expected_logits.i(step).unwrap(), TOL));
        let next = argmax(&row);
        generated.push(next);
        embeds = llama.embed_tokens(&[next]).unwrap();
    }
    eprintln!("generate_logits: worst max abs diff {worst:.3e}");
    assert_eq!(generated, expected_ids);
    // Prefill plus 7 one-token steps; the 8th token was never fed back.
    assert_eq!(cache.len(), ids.len() + expected_ids.len() - 1);
}
