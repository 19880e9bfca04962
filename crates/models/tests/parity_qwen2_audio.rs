//! Parity with transformers on the tiny Qwen2-Audio fixture (f32, CPU): the audio
//! encoder layer by layer with the padded-key mask, the projector, the Qwen2 LM's
//! logits with the audio rows merged in, and 8 greedy tokens.

mod common;

use candle_core::{IndexOp, Tensor};
use common::{Reference, argmax, assert_close, audio_fixture_dir};
use mmserve_config::{ModelConfig, ModelDir, audio_token_count};
use mmserve_models::{Llama, Placement, Qwen2AudioEncoder, SeqInput, merge_image_embeddings};

const TOL: f32 = 1e-4;

struct Fixture {
    r: Reference,
    encoder: Qwen2AudioEncoder,
    llama: Llama,
    audio_token: u32,
    valid_frames: usize,
}

fn fixture() -> Fixture {
    let dir = ModelDir::open(audio_fixture_dir()).unwrap();
    let ModelConfig::Qwen2Audio(cfg) = &dir.config else { panic!("not a Qwen2-Audio config") };
    let r = Reference::at(&audio_fixture_dir());
    let mask = r.tensor("feature_attention_mask").flatten_all().unwrap().to_vec1::<i64>().unwrap();
    let valid_frames = mask.iter().filter(|&&m| m == 1).count();
    Fixture {
        encoder: Qwen2AudioEncoder::load(&dir, &Placement::cpu()).unwrap(),
        llama: Llama::load(&dir, &Placement::cpu()).unwrap(),
        audio_token: cfg.audio_token_index,
        valid_frames,
        r,
    }
}

impl Fixture {
    /// The prompt's input embeddings: text rows, audio rows at the `<|AUDIO|>` positions.
    fn prompt_embeds(&self) -> (Vec<u32>, Tensor) {
        let ids = self.r.ids("input_ids");
        let rows = self.encoder.encode(&self.r.tensor("input_features"), &[self.valid_frames]).unwrap();
        let embeds = merge_image_embeddings(&self.llama, &ids, self.audio_token, &rows[0]).unwrap();
        (ids, embeds)
    }
}

#[test]
fn audio_encoder_and_projector_match_transformers() {
    let f = fixture();
    assert_eq!(f.valid_frames, 137);
    assert_eq!(audio_token_count(f.valid_frames), 34);
    let out = f.encoder.forward(&f.r.tensor("input_features"), &[f.valid_frames]).unwrap();
    for (i, layer) in out.layer_outputs.iter().enumerate() {
        let name = format!("encoder_layer_{i}_output");
        assert_close(&name, layer, &f.r.tensor(&name), TOL);
    }
    assert_close("mm_projector_output", &out.projected, &f.r.tensor("mm_projector_output"), TOL);
    let rows = f.encoder.encode(&f.r.tensor("input_features"), &[f.valid_frames]).unwrap();
    assert_eq!(rows[0].dims(), &[34, 64]);
}

#[test]
fn the_key_mask_is_what_keeps_valid_rows_in_place() {
    // As if every frame were real: the valid rows move far beyond the tolerance.
    let f = fixture();
    let unmasked = f.encoder.forward(&f.r.tensor("input_features"), &[3000]).unwrap();
    let valid = |t: &Tensor| t.i((.., 0..34, ..)).unwrap();
    let want = valid(&f.r.tensor("mm_projector_output"));
    let err = common::max_abs_diff(&valid(&unmasked.projected), &want);
    assert!(err > 1e-2, "the mask made no difference ({err})");
}

#[test]
fn a_batch_of_clips_gives_each_clip_its_own_rows() {
    let f = fixture();
    let features = f.r.tensor("input_features");
    let alone = f.encoder.encode(&features, &[f.valid_frames]).unwrap();
    let batch = Tensor::cat(&[&features, &features], 0).unwrap();
    let both = f.encoder.encode(&batch, &[f.valid_frames, 3000]).unwrap();
    assert_close("clip 0 in a batch", &both[0], &alone[0], 1e-5);
    assert_eq!(both[1].dims(), &[750, 64]);
}

#[test]
fn language_model_matches_transformers() {
    let f = fixture();
    let (ids, embeds) = f.prompt_embeds();
    assert_eq!(ids.iter().filter(|&&id| id == f.audio_token).count(), 34);
    let hidden_states = f.r.tensor("hidden_states");
    assert_close("merged input embeddings", &embeds, &hidden_states.i(0).unwrap(), TOL);
    let mut cache = f.llama.new_cache();
    let logits = f.llama.forward(&embeds, &mut [SeqInput { new_tokens: ids.len(), cache: &mut cache }], true).unwrap();
    assert_close("logits", &logits, &f.r.tensor("logits"), TOL);

    let text_ids = f.r.ids("text_only_input_ids");
    let mut cache = f.llama.new_cache();
    let text = f.llama.embed_tokens(&text_ids).unwrap();
    let seq = SeqInput { new_tokens: text_ids.len(), cache: &mut cache };
    let logits = f.llama.forward(&text, &mut [seq], true).unwrap();
    assert_close("text_only_logits", &logits, &f.r.tensor("text_only_logits"), TOL);
}

#[test]
fn greedy_generation_matches_transformers() {
    let f = fixture();
    let (_, mut embeds) = f.prompt_embeds();
    let expected_ids = f.r.ids("generated_ids");
    let expected_logits = f.r.tensor("generate_logits");
    let mut cache = f.llama.new_cache();
    let mut generated = Vec::new();
    for step in 0..expected_ids.len() {
        let seq = SeqInput { new_tokens: embeds.dim(0).unwrap(), cache: &mut cache };
        let logits = f.llama.forward(&embeds, &mut [seq], false).unwrap();
        let row = logits.i(0).unwrap();
        assert_close(&format!("generate_logits[{step}]"), &row, &expected_logits.i(step).unwrap(), TOL);
        let next = argmax(&row);
        generated.push(next);
        embeds = f.llama.embed_tokens(&[next]).unwrap();
    }
    assert_eq!(generated, expected_ids);
}
