//! Against transformers' own outputs (fixtures made with transformers 5.24 / PIL 13).

use std::path::{Path, PathBuf};

use mmserve_media::{ClipImageProcessor, ImageLimits, RgbImage, decode_image, resize_bicubic};
use safetensors::{Dtype, SafeTensors};

fn path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn read(rel: &str) -> Vec<u8> {
    std::fs::read(path(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn tensor<'a>(st: &'a SafeTensors, name: &str, dtype: Dtype, shape: &[usize]) -> &'a [u8] {
    let t = st.tensor(name).unwrap();
    assert_eq!((t.dtype(), t.shape()), (dtype, shape), "{name}");
    t.data()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

const LLAVA: &str = "../../assets/models/llava-tiny";

#[test]
fn llava_decode_matches_pil() {
    let st_bytes = read(&format!("{LLAVA}/reference.safetensors"));
    let st = SafeTensors::deserialize(&st_bytes).unwrap();
    let img = decode_image(&read(&format!("{LLAVA}/input.png")), &ImageLimits::default()).unwrap();
    assert_eq!(img.dimensions(), (80, 64));
    assert!(img.as_raw() == tensor(&st, "image_rgb_u8", Dtype::U8, &[64, 80, 3]));
}

#[test]
fn llava_pixel_values_match_transformers() {
    let st_bytes = read(&format!("{LLAVA}/reference.safetensors"));
    let st = SafeTensors::deserialize(&st_bytes).unwrap();
    let cfg: serde_json::Value = serde_json::from_slice(&read(&format!("{LLAVA}/preprocessor_config.json"))).unwrap();
    let proc = ClipImageProcessor::from_json(&cfg).unwrap();
    assert_eq!(proc.output_size(), (56, 56));
    let img = decode_image(&read(&format!("{LLAVA}/input.png")), &ImageLimits::default()).unwrap();
    let ours = proc.preprocess(&img).unwrap();
    let theirs = f32s(tensor(&st, "pixel_values", Dtype::F32, &[1, 3, 56, 56]));
    let err = max_abs_diff(&ours, &theirs);
    println!("llava pixel_values max abs error: {err:e}");
    assert!(err <= 1e-6, "max abs error {err}");
}

/// Qwen2-VL resizes 100×80 up to 112×84 with the same PIL bicubic; its
/// `pixel_values` rows are 2×2-merge-ordered patches of `[channel, temporal(2), 14, 14]`.
#[test]
fn qwen2_vl_upscale_matches_transformers() {
    let st_bytes = read("tests/data/qwen2_vl_reference_subset.safetensors");
    let st = SafeTensors::deserialize(&st_bytes).unwrap();
    let img = decode_image(&read("tests/data/qwen2_vl_input.png"), &ImageLimits::default()).unwrap();
    assert!(img.as_raw() == tensor(&st, "image_rgb_u8", Dtype::U8, &[80, 100, 3]));
    let thw = tensor(&st, "image_grid_thw", Dtype::I64, &[1, 3]);
    let thw: Vec<i64> = thw.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect();
    assert_eq!(thw, [1, 6, 8]);

    let resized: RgbImage = resize_bicubic(&img, 112, 84);
    let (mean, std) = (
        [0.48145466f64, 0.4578275, 0.40821073].map(|x| x as f32),
        [0.26862954f64, 0.26130258, 0.27577711].map(|x| x as f32),
    );
    let (patch, merge, grid_w) = (14, 2, 8);
    let theirs = f32s(tensor(&st, "pixel_values_first24", Dtype::F32, &[24, 1176]));
    let mut ours = vec![0f32; theirs.len()];
    for (row, out) in ours.chunks_exact_mut(1176).enumerate() {
        let (block, mh, mw) = (row / 4, row / 2 % 2, row % 2);
        let (bh, bw) = (block / (grid_w / merge), block % (grid_w / merge));
        let (py0, px0) = ((bh * merge + mh) * patch, (bw * merge + mw) * patch);
        for (i, v) in out.iter_mut().enumerate() {
            let (c, _t, y, x) = (i / 392, i / 196 % 2, i / 14 % 14, i % 14);
            let level = resized.get_pixel((px0 + x) as u32, (py0 + y) as u32)[c];
            *v = ((f64::from(level) * (1.0 / 255.0)) as f32 - mean[c]) / std[c];
        }
    }
    let err = max_abs_diff(&ours, &theirs);
    println!("qwen2_vl first 24 patch rows max abs error: {err:e}");
    assert!(err <= 1e-6, "max abs error {err}");
}

/// `Qwen2VlImageProcessor` end to end (decode, smart_resize, resize, patches) against the
/// Qwen2-VL fixture's `pixel_values` and `image_grid_thw`; and, where the shared fixtures
/// are present, the full tensors of Qwen2-VL and Qwen2.5-VL.
#[test]
fn qwen2_vl_processor_matches_transformers() {
    use mmserve_media::Qwen2VlImageProcessor;
    let cfg: serde_json::Value = serde_json::json!({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"
    });
    let proc = Qwen2VlImageProcessor::from_json(&cfg).unwrap();
    let img = decode_image(&read("tests/data/qwen2_vl_input.png"), &ImageLimits::default()).unwrap();
    assert_eq!(proc.num_tokens(80, 100).unwrap(), 12);
    let ours = proc.preprocess(&img).unwrap();
    assert_eq!(ours.grid_thw, [1, 6, 8]);
    assert_eq!((ours.num_patches(), ours.patch_dim()), (48, 1176));
    let st_bytes = read("tests/data/qwen2_vl_reference_subset.safetensors");
    let st = SafeTensors::deserialize(&st_bytes).unwrap();
    let theirs = f32s(tensor(&st, "pixel_values_first24", Dtype::F32, &[24, 1176]));
    let err = max_abs_diff(&ours.pixel_values[..24 * 1176], &theirs);
    println!("qwen2_vl processor, first 24 rows: max abs error {err:e}");
    assert!(err <= 1e-6, "max abs error {err}");

    for model in ["qwen2_vl", "qwen2_5_vl"] {
        let dir = format!("../../../shared/fixtures/models/{model}");
        if !path(&dir).join("reference.safetensors").exists() {
            println!("{dir}: not present, skipped");
            continue;
        }
        let cfg: serde_json::Value = serde_json::from_slice(&read(&format!("{dir}/preprocessor_config.json"))).unwrap();
        let proc = mmserve_media::ImageProcessor::from_json(&cfg).unwrap();
        let img = decode_image(&read(&format!("{dir}/input.png")), &ImageLimits::default()).unwrap();
        let st_bytes = read(&format!("{dir}/reference.safetensors"));
        let st = SafeTensors::deserialize(&st_bytes).unwrap();
        assert!(img.as_raw() == tensor(&st, "image_rgb_u8", Dtype::U8, &[80, 100, 3]), "{model} decode");
        let ours = proc.preprocess(&img).unwrap();
        assert_eq!(ours.shape(), [48, 1176]);
        let theirs = f32s(tensor(&st, "pixel_values", Dtype::F32, &[48, 1176]));
        let err = max_abs_diff(ours.pixel_values(), &theirs);
        println!("{model} processor, all 48 rows: max abs error {err:e}");
        assert!(err <= 1e-6, "{model}: max abs error {err}");
        let thw = tensor(&st, "image_grid_thw", Dtype::I64, &[1, 3]);
        let thw: Vec<i64> = thw.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect();
        assert_eq!(thw, [1, 6, 8]);
        assert_eq!(proc.num_tokens(100, 80).unwrap(), Some(12));
    }
}

/// M-RoPE positions of the Qwen2-VL fixture's prompt (its `<|image_pad|>` run is the
/// image's 1×3×4 merged grid) equal transformers' `position_ids`, all three streams.
#[test]
fn mrope_positions_match_transformers() {
    use mmserve_media::mrope::{Span, mrope_positions};
    for fixture in ["qwen2-vl-tiny", "qwen2.5-vl-tiny"] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/models").join(fixture);
        let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let i64s = |name: &str| -> Vec<i64> {
            st.tensor(name).unwrap().data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect()
        };
        let ids = i64s("input_ids");
        let image_token = 2012;
        let first = ids.iter().position(|&t| t == image_token).unwrap();
        let count = ids.iter().filter(|&&t| t == image_token).count();
        assert_eq!(count, 12);
        let spans = [Span::Text(first), Span::Image { t: 1, h: 3, w: 4 }, Span::Text(ids.len() - first - count)];
        let (pos, _) = mrope_positions(&spans);
        let want = i64s("position_ids");
        let l = ids.len();
        for (s, stream) in pos.iter().enumerate() {
            assert_eq!(stream.as_slice(), &want[s * l..(s + 1) * l], "{fixture}: stream {s}");
        }
    }
}
