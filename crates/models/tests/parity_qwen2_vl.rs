//! Parity with transformers on the tiny Qwen2-VL fixture (f32, CPU): the vision tower
//! block by block (2-D rotary positions, attention within the image) and the patch
//! merger's output.

mod common;

use candle_core::{DType, Device};
use common::{Reference, assert_close};
use mmserve_config::{Qwen2VisionConfig, WeightFiles};
use mmserve_models::{Grid, Qwen2VisionTower, Weights};

const TOL: f32 = 1e-4;

fn dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/models/qwen2-vl-tiny")
}

#[test]
fn vision_tower_and_merger_match_transformers() {
    let dir = dir();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = Qwen2VisionConfig::from_json(&config).unwrap();
    let weights = Weights::open(&WeightFiles::Single(dir.join("model.safetensors")), &Device::Cpu, DType::F32).unwrap();
    let tower = Qwen2VisionTower::from_weights(&weights, &cfg).unwrap();
    let r = Reference::at(&dir);
    let thw = r.tensor("image_grid_thw").flatten_all().unwrap().to_vec1::<i64>().unwrap();
    let grid = Grid { t: thw[0] as usize, h: thw[1] as usize, w: thw[2] as usize };
    assert_eq!((grid.t, grid.h, grid.w), (1, 6, 8));
    let (layers, merged) = tower.forward_layers(&r.tensor("pixel_values"), &[grid]).unwrap();
    for (i, out) in layers.iter().enumerate() {
        assert_close(&format!("vision block {i}"), out, &r.tensor(&format!("encoder_layer_{i}_output")), TOL);
    }
    assert_close("merger", &merged, &r.tensor("mm_projector_output"), TOL);
    // Two copies of the image in one packed call: each attends only to itself.
    let pixels = r.tensor("pixel_values");
    let both = candle_core::Tensor::cat(&[&pixels, &pixels], 0).unwrap();
    let twice = tower.forward(&both, &[grid, grid]).unwrap();
    assert_close("second image of a pair", &twice.narrow(0, 12, 12).unwrap(), &r.tensor("mm_projector_output"), TOL);
}

/// Qwen2.5-VL: RMSNorm, the SwiGLU MLP, window attention in block 0 (the 3×4 grid of
/// merged patches does not divide into the 2×2 windows: the last row and column of
/// windows are short) and full attention in block 1; tied embeddings elsewhere.
#[test]
fn qwen2_5_vision_tower_with_windows_matches_transformers() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/models/qwen2.5-vl-tiny");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = Qwen2VisionConfig::from_json(&config).unwrap();
    assert!(cfg.window.is_some());
    let weights = Weights::open(&WeightFiles::Single(dir.join("model.safetensors")), &Device::Cpu, DType::F32).unwrap();
    let tower = Qwen2VisionTower::from_weights(&weights, &cfg).unwrap();
    let r = Reference::at(&dir);
    let grid = Grid { t: 1, h: 6, w: 8 };
    let (layers, merged) = tower.forward_layers(&r.tensor("pixel_values"), &[grid]).unwrap();
    for (i, out) in layers.iter().enumerate() {
        assert_close(
            &format!("vision block {i} (window order)"),
            out,
            &r.tensor(&format!("encoder_layer_{i}_output")),
            TOL,
        );
    }
    // transformers' merger output is in window order (it reorders after): merged groups
    // 0, 1, 4, 5 | 2, 3, 6, 7 | 8, 9 | 10, 11 of the 3×4 grid.
    let order = candle_core::Tensor::new(&[0u32, 1, 4, 5, 2, 3, 6, 7, 8, 9, 10, 11], &Device::Cpu).unwrap();
    let windowed = merged.index_select(&order, 0).unwrap();
    assert_close("merger (in window order)", &windowed, &r.tensor("mm_projector_output"), TOL);
}

/// The Qwen2 language model at M-RoPE positions: the prompt with the merger's rows at
/// the `<|image_pad|>` positions gives transformers' logits; the text-only prompt (all
/// three streams alike) too; 8 greedy tokens, each at the next position in all streams,
/// are transformers'. Both fixtures (Qwen2.5-VL's has tied embeddings).
#[test]
fn language_model_at_mrope_positions_matches_transformers() {
    use mmserve_config::LlamaConfig;
    use mmserve_media::mrope::{Span, mrope_positions};
    use mmserve_models::{Llama, merge_image_embeddings};
    for name in ["qwen2-vl-tiny", "qwen2.5-vl-tiny"] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/models").join(name);
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let text = LlamaConfig::qwen2_from_json(&config, false).unwrap();
        assert_eq!(text.mrope_section, [2, 3, 3]);
        let weights =
            Weights::open(&WeightFiles::Single(dir.join("model.safetensors")), &Device::Cpu, DType::F32).unwrap();
        let llama = Llama::from_weights(&weights, &text).unwrap();
        let tower = Qwen2VisionTower::from_weights(&weights, &Qwen2VisionConfig::from_json(&config).unwrap()).unwrap();
        let r = Reference::at(&dir);
        let ids = r.ids("input_ids");
        let rows = tower.forward(&r.tensor("pixel_values"), &[Grid { t: 1, h: 6, w: 8 }]).unwrap();
        let image_token = 2012;
        let embeds = merge_image_embeddings(&llama, &ids, image_token, &rows).unwrap();
        let first = ids.iter().position(|&t| t == image_token).unwrap();
        let spans = [Span::Text(first), Span::Image { t: 1, h: 3, w: 4 }, Span::Text(ids.len() - first - 12)];
        let (mut pos, delta) = mrope_positions(&spans);
        let logits = llama.forward_mrope(&embeds, &pos).unwrap();
        assert_close(&format!("{name}: logits"), &logits, &r.tensor("logits"), TOL);
        // Greedy, each new token one past the last position in all three streams.
        let mut embeds = embeds;
        let mut got = Vec::new();
        for _ in 0..8 {
            let logits = llama.forward_mrope(&embeds, &pos).unwrap();
            let last = logits.get(logits.dim(0).unwrap() - 1).unwrap();
            let next = last.argmax(0).unwrap().to_scalar::<u32>().unwrap();
            got.push(next);
            let p = pos[0].len() as i64 + delta;
            for s in &mut pos {
                s.push(p);
            }
            embeds = candle_core::Tensor::cat(&[&embeds, &llama.embed_tokens(&[next]).unwrap()], 0).unwrap();
        }
        assert_eq!(got, r.ids("generated_ids"), "{name}: greedy tokens");
        // The text-only prompt: M-RoPE with three equal streams is the plain rotary.
        let text_ids = r.ids("text_only_input_ids");
        let (tp, _) = mrope_positions(&[Span::Text(text_ids.len())]);
        let logits = llama.forward_mrope(&llama.embed_tokens(&text_ids).unwrap(), &tp).unwrap();
        assert_close(&format!("{name}: text-only logits"), &logits, &r.tensor("text_only_logits"), TOL);
    }
}

/// The same prompt through the paged KV pool, in two prefill chunks that split the
/// image's rows, then 8 greedy decode steps: transformers' last-row logits and tokens.
#[test]
fn the_paged_path_carries_mrope_positions() {
    use mmserve_config::LlamaConfig;
    use mmserve_media::mrope::{Span, mrope_positions};
    use mmserve_models::{Llama, MropePositions, PagedKv, PagedSeq, merge_image_embeddings};
    let dir = dir();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let weights = Weights::open(&WeightFiles::Single(dir.join("model.safetensors")), &Device::Cpu, DType::F32).unwrap();
    let llama = Llama::from_weights(&weights, &LlamaConfig::qwen2_from_json(&config, false).unwrap()).unwrap();
    let tower = Qwen2VisionTower::from_weights(&weights, &Qwen2VisionConfig::from_json(&config).unwrap()).unwrap();
    let r = Reference::at(&dir);
    let ids = r.ids("input_ids");
    let rows = tower.forward(&r.tensor("pixel_values"), &[Grid { t: 1, h: 6, w: 8 }]).unwrap();
    let embeds = merge_image_embeddings(&llama, &ids, 2012, &rows).unwrap();
    let first = ids.iter().position(|&t| t == 2012).unwrap();
    let spans = [Span::Text(first), Span::Image { t: 1, h: 3, w: 4 }, Span::Text(ids.len() - first - 12)];
    let (prompt, delta) = mrope_positions(&spans);
    let mrope = MropePositions { prompt, delta };
    let (bs, n) = (4, ids.len());
    let blocks = (n + 8).div_ceil(bs);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let mut kv = PagedKv::new(&llama, blocks, bs, DType::F32).unwrap();
    // A chunk boundary inside the image's rows.
    let cut = first + 5;
    let seq = |start, new_tokens| PagedSeq { start, new_tokens, block_table: &table, mrope: Some(&mrope) };
    llama.forward_paged(&embeds.narrow(0, 0, cut).unwrap(), &[seq(0, cut)], &mut kv, false).unwrap();
    let last =
        llama.forward_paged(&embeds.narrow(0, cut, n - cut).unwrap(), &[seq(cut, n - cut)], &mut kv, false).unwrap();
    assert_close("last-row logits", &last.squeeze(0).unwrap(), &r.tensor("logits_last"), TOL);
    let mut next = last.squeeze(0).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap();
    let mut got = vec![next];
    for step in 0..7 {
        let row = llama.embed_tokens(&[next]).unwrap();
        let logits = llama.forward_paged(&row, &[seq(n + step, 1)], &mut kv, false).unwrap();
        next = logits.squeeze(0).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap();
        got.push(next);
    }
    assert_eq!(got, r.ids("generated_ids"));
}
