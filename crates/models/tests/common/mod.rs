//! Helpers shared by the tests: the tiny fixtures and their transformers references.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};

pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/models/llava-tiny")
}

pub fn audio_fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/models/qwen2-audio-tiny")
}

pub struct Reference(HashMap<String, Tensor>);

impl Reference {
    pub fn load() -> Self {
        Self::at(&fixture_dir())
    }

    pub fn at(dir: &std::path::Path) -> Self {
        let path = dir.join("reference.safetensors");
        Reference(candle_core::safetensors::load(path, &Device::Cpu).expect("reference.safetensors"))
    }

    pub fn tensor(&self, name: &str) -> Tensor {
        self.0.get(name).unwrap_or_else(|| panic!("reference has no {name}")).clone()
    }

    pub fn ids(&self, name: &str) -> Vec<u32> {
        let ids = self.tensor(name).to_vec1::<i64>().unwrap();
        ids.into_iter().map(|id| u32::try_from(id).unwrap()).collect()
    }
}

/// Largest absolute elementwise difference; panics on a shape mismatch.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
    d.max(0).unwrap().to_scalar::<f32>().unwrap()
}

/// Asserts `a` ≈ `b` within `tol`, printing the measured error.
pub fn assert_close(what: &str, a: &Tensor, b: &Tensor, tol: f32) -> f32 {
    let err = max_abs_diff(a, b);
    eprintln!("{what}: max abs diff {err:.3e}");
    assert!(err <= tol, "{what}: max abs diff {err} > {tol}");
    err
}

pub fn argmax(row: &Tensor) -> u32 {
    let v = row.to_vec1::<f32>().unwrap();
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// The fixture's language model with its two prompts as input embeddings: the image
/// prompt (projector rows merged in) and the text-only prompt.
pub fn prompts() -> (mmserve_models::Llama, Tensor, Tensor) {
    use mmserve_models::{Llama, LlavaVision, Placement, merge_image_embeddings};
    let r = Reference::load();
    let dir = mmserve_config::ModelDir::open(fixture_dir()).unwrap();
    let vision = LlavaVision::load(&dir, &Placement::cpu()).unwrap();
    let llama = Llama::load(&dir, &Placement::cpu()).unwrap();
    let features = vision.encode(&r.tensor("pixel_values")).unwrap();
    let image = merge_image_embeddings(&llama, &r.ids("input_ids"), 1000, &features).unwrap();
    let text = llama.embed_tokens(&r.ids("text_only_input_ids")).unwrap();
    (llama, image, text)
}
