//! `mmserve preprocess` writes what transformers' processors produce for the fixtures.

mod common;

use std::path::Path;
use std::process::Command;

use safetensors::SafeTensors;

fn preprocess(model: &str, file: &str) -> Vec<u8> {
    let dir = common::repo().join("assets/models").join(model);
    let tmp = common::cache::temp_dir(&format!("preprocess-{model}"));
    let out = tmp.join("out.safetensors");
    let status = Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .args(["preprocess", "--model"])
        .arg(&dir)
        .arg(dir.join(file))
        .arg("--out")
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::read(out).unwrap()
}

fn f32s(t: &SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<f32>) {
    let v = t.tensor(name).unwrap();
    (v.shape().to_vec(), v.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
}

fn i64s(t: &SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<i64>) {
    let v = t.tensor(name).unwrap();
    (v.shape().to_vec(), v.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect())
}

fn reference(model: &str) -> Vec<u8> {
    std::fs::read(Path::new(&common::repo()).join("assets/models").join(model).join("reference.safetensors")).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn llava_pixel_values_match_transformers_exactly() {
    let (out, refs) = (preprocess("llava-tiny", "input.png"), reference("llava-tiny"));
    let (out, refs) = (SafeTensors::deserialize(&out).unwrap(), SafeTensors::deserialize(&refs).unwrap());
    let (shape, ours) = f32s(&out, "pixel_values");
    let (want_shape, theirs) = f32s(&refs, "pixel_values");
    assert_eq!(shape, want_shape);
    assert_eq!(max_diff(&ours, &theirs), 0.0);
    assert_eq!(i64s(&out, "num_tokens").1, vec![16]);
}

#[test]
fn qwen2_vl_patches_and_grid_match_transformers_exactly() {
    let (out, refs) = (preprocess("qwen2-vl-tiny", "input.png"), reference("qwen2-vl-tiny"));
    let (out, refs) = (SafeTensors::deserialize(&out).unwrap(), SafeTensors::deserialize(&refs).unwrap());
    let (shape, ours) = f32s(&out, "pixel_values");
    let (want_shape, theirs) = f32s(&refs, "pixel_values");
    assert_eq!(shape, want_shape);
    assert_eq!(max_diff(&ours, &theirs), 0.0);
    assert_eq!(i64s(&out, "image_grid_thw"), i64s(&refs, "image_grid_thw"));
    assert_eq!(i64s(&out, "num_tokens").1, vec![12]);
}

#[test]
fn qwen2_audio_features_match_transformers() {
    let (out, refs) = (preprocess("qwen2-audio-tiny", "input.wav"), reference("qwen2-audio-tiny"));
    let (out, refs) = (SafeTensors::deserialize(&out).unwrap(), SafeTensors::deserialize(&refs).unwrap());
    let (shape, ours) = f32s(&out, "input_features");
    let (want_shape, theirs) = f32s(&refs, "input_features");
    assert_eq!(shape, want_shape);
    let err = max_diff(&ours, &theirs);
    assert!(err < 1e-4, "input_features differ by {err}");
    assert_eq!(i64s(&out, "feature_attention_mask"), i64s(&refs, "feature_attention_mask"));
    assert_eq!(i64s(&out, "num_tokens").1, vec![34]);
}

#[test]
fn bench_preprocess_reports_each_file_and_each_thread_count() {
    let dir = common::repo().join("assets/models/llava-tiny");
    let bench = |files: &[&Path]| {
        Command::new(env!("CARGO_BIN_EXE_mmserve"))
            .args(["bench", "preprocess", "--json", "--repeat", "1", "--threads", "2,1", "--preprocessor"])
            .arg(dir.join("preprocessor_config.json"))
            .args(files)
            .output()
            .unwrap()
    };
    let image = dir.join("input.png");
    let out = bench(&[&image, &image]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    // Two files, then the thread counts in ascending order, each scaled by one thread's.
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert!(lines[..2].iter().all(|l| l["seconds"].as_f64().unwrap() > 0.0), "{lines:?}");
    assert_eq!(lines[2]["threads"], 1);
    assert_eq!(lines[2]["scaling"], 1.0);
    assert_eq!(lines[3]["threads"], 2);
    assert!(lines[3]["items_per_second"].as_f64().unwrap() > 0.0, "{lines:?}");

    // A file that is not an image fails the run with an error that names the problem.
    let tmp = common::cache::temp_dir("bench-preprocess");
    let bad = tmp.join("bad.jpg");
    std::fs::write(&bad, b"not an image").unwrap();
    let out = bench(&[&bad]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("could not be decoded"), "{out:?}");
}
