//! Checkpoints saved with transformers v5 tensor names, tied embeddings, and broken
//! checkpoints (errors, not panics).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::{Reference, assert_close, fixture_dir, max_abs_diff};
use mmserve_config::ModelDir;
use mmserve_models::{Llama, LlavaVision, ModelError, Naming, Placement, SeqInput, Weights};

/// A model directory under the temp dir holding the fixture's config.json and the given
/// tensors; removed on drop.
struct TempModel(PathBuf);

impl TempModel {
    fn new(name: &str, tensors: &HashMap<String, Tensor>) -> Self {
        let dir = std::env::temp_dir().join(format!("mmserve-models-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(fixture_dir().join("config.json"), dir.join("config.json")).unwrap();
        candle_core::safetensors::save(tensors, dir.join("model.safetensors")).unwrap();
        TempModel(dir)
    }

    fn open(&self) -> ModelDir {
        ModelDir::open(&self.0).unwrap()
    }
}

impl Drop for TempModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn hub_tensors() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture_dir().join("model.safetensors"), &Device::Cpu).unwrap()
}

fn v5_name(name: &str) -> String {
    for (hub, v5) in [
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ] {
        if let Some(rest) = name.strip_prefix(hub) {
            return format!("{v5}{rest}");
        }
    }
    panic!("unexpected tensor name {name}")
}

/// Image-prompt logits [45, 1024] of the model in `dir`.
fn prompt_logits(dir: &Path) -> Tensor {
    let r = Reference::load();
    let dir = ModelDir::open(dir).unwrap();
    let vision = LlavaVision::load(&dir, &Placement::cpu()).unwrap();
    let llama = Llama::load(&dir, &Placement::cpu()).unwrap();
    let ids = r.ids("input_ids");
    let image = vision.encode(&r.tensor("pixel_values")).unwrap();
    let embeds = mmserve_models::merge_image_embeddings(&llama, &ids, 1000, &image).unwrap();
    let mut cache = llama.new_cache();
    llama.forward(&embeds, &mut [SeqInput { new_tokens: ids.len(), cache: &mut cache }], true).unwrap()
}

#[test]
fn v5_tensor_names_load_and_give_the_same_logits() {
    let renamed = hub_tensors().into_iter().map(|(k, v)| (v5_name(&k), v)).collect();
    let model = TempModel::new("v5", &renamed);
    let files = model.open().weight_files().unwrap();
    let weights = Weights::open(&files, &Device::Cpu, DType::F32).unwrap();
    assert_eq!(weights.naming(), Naming::V5);

    let hub = prompt_logits(&fixture_dir());
    let v5 = prompt_logits(&model.0);
    assert_eq!(max_abs_diff(&hub, &v5), 0.0);
    assert_close("v5 names vs reference logits", &v5, &Reference::load().tensor("logits"), 1e-4);
}

/// transformers 5.24 saves a newly made LLaVA's CLIP tower one level up
/// (`vision_tower.encoder.*`, no `vision_model`), in either naming.
#[test]
fn a_tower_saved_without_vision_model_loads_the_same() {
    let hub = prompt_logits(&fixture_dir());
    for v5 in [false, true] {
        let renamed = hub_tensors()
            .into_iter()
            .map(|(k, v)| {
                let k = k.replace("vision_tower.vision_model.", "vision_tower.");
                (if v5 { v5_name(&k) } else { k }, v)
            })
            .collect();
        let model = TempModel::new(if v5 { "flat-tower-v5" } else { "flat-tower" }, &renamed);
        assert_eq!(max_abs_diff(&hub, &prompt_logits(&model.0)), 0.0, "v5 names: {v5}");
    }
}

/// transformers 5.17 saves a newly made Qwen2-Audio's language model one `model.` deeper
/// (`language_model.model.model.*`), and 5.24 loads that; so do we.
#[test]
fn a_language_model_saved_one_level_deeper_loads_the_same() {
    let hub = prompt_logits(&fixture_dir());
    let renamed = hub_tensors()
        .into_iter()
        .map(|(k, v)| (k.replace("language_model.model.", "language_model.model.model."), v))
        .collect();
    let model = TempModel::new("nested-lm", &renamed);
    assert_eq!(max_abs_diff(&hub, &prompt_logits(&model.0)), 0.0);
}

#[test]
fn missing_lm_head_falls_back_to_tied_embeddings() {
    let mut tensors = hub_tensors();
    let embed = tensors["language_model.model.embed_tokens.weight"].clone();
    tensors.remove("language_model.lm_head.weight");
    let model = TempModel::new("tied", &tensors);
    let dir = model.open();
    let llama = Llama::load(&dir, &Placement::cpu()).unwrap();
    let embeds = llama.embed_tokens(&Reference::load().ids("text_only_input_ids")).unwrap();
    let n = embeds.dim(0).unwrap();
    let (mut c1, mut c2) = (llama.new_cache(), llama.new_cache());
    let logits = llama.forward(&embeds, &mut [SeqInput { new_tokens: n, cache: &mut c1 }], true).unwrap();
    let hidden = llama.forward_hidden(&embeds, &mut [SeqInput { new_tokens: n, cache: &mut c2 }], true).unwrap();
    let tied = hidden.matmul(&embed.t().unwrap()).unwrap();
    assert_close("tied lm_head", &logits, &tied, 1e-5);
}

#[test]
fn broken_checkpoints_are_errors() {
    let mut missing = hub_tensors();
    missing.remove("language_model.model.layers.1.mlp.up_proj.weight");
    let model = TempModel::new("missing", &missing);
    match Llama::load(&model.open(), &Placement::cpu()) {
        Err(ModelError::MissingTensor(name)) => {
            assert_eq!(name, "language_model.model.layers.1.mlp.up_proj.weight")
        }
        other => panic!("expected MissingTensor, got {:?}", other.err()),
    }

    let mut wrong = hub_tensors();
    let name = "multi_modal_projector.linear_1.weight".to_string();
    wrong.insert(name.clone(), Tensor::zeros((64, 31), DType::F32, &Device::Cpu).unwrap());
    let model = TempModel::new("shape", &wrong);
    match LlavaVision::load(&model.open(), &Placement::cpu()) {
        Err(ModelError::ShapeMismatch { name: n, expected, found }) => {
            assert_eq!((n, expected, found), (name, vec![64, 32], vec![64, 31]));
        }
        other => panic!("expected ShapeMismatch, got {:?}", other.err()),
    }

    let unrelated: HashMap<String, Tensor> =
        [("foo".to_string(), Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap())].into();
    let model = TempModel::new("unrelated", &unrelated);
    assert!(matches!(Llama::load(&model.open(), &Placement::cpu()), Err(ModelError::MissingTensor(_))));
}

#[test]
fn sharded_checkpoints_load_through_their_index() {
    let tensors = hub_tensors();
    let dir = TempModel::new("sharded", &HashMap::new());
    std::fs::remove_file(dir.0.join("model.safetensors")).unwrap();
    // Vision and projector in one shard, the language model in the other.
    let mut shards: [HashMap<String, Tensor>; 2] = Default::default();
    let mut weight_map = serde_json::Map::new();
    for (name, t) in tensors {
        let k = usize::from(name.starts_with("language_model."));
        let file = format!("model-0000{}-of-00002.safetensors", k + 1);
        weight_map.insert(name.clone(), serde_json::Value::String(file));
        shards[k].insert(name, t);
    }
    for (k, shard) in shards.iter().enumerate() {
        candle_core::safetensors::save(shard, dir.0.join(format!("model-0000{}-of-00002.safetensors", k + 1))).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.0.join("model.safetensors.index.json"), index.to_string()).unwrap();
    assert!(matches!(dir.open().weight_files().unwrap(), mmserve_config::WeightFiles::Sharded(ref v) if v.len() == 2));
    let logits = prompt_logits(&dir.0);
    let r = Reference::load();
    assert_close("sharded logits", &logits, &r.tensor("logits"), 1e-4);
}
