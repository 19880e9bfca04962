//! Parity with transformers 5.24 / Pillow 13 on the images made by `tests/data/make_images.py`
//! (every format and mode the server decodes, EXIF orientations, colour keys, processors).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use mmserve_media::{
    ClipImageProcessor, ImageFormat, ImageLimits, ImagePixels, ImageProcessor, MediaError, Qwen2VlImageProcessor,
    RgbImage, decode_image, image_header, smart_resize,
};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

fn data(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(rel)
}

fn read(rel: &str) -> Vec<u8> {
    std::fs::read(data(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

struct Fixtures {
    manifest: Value,
    tensors: Vec<u8>,
}

fn fixtures() -> &'static Fixtures {
    static F: OnceLock<Fixtures> = OnceLock::new();
    F.get_or_init(|| Fixtures {
        manifest: serde_json::from_slice(&read("image_cases.json")).unwrap(),
        tensors: read("image_expected.safetensors"),
    })
}

fn tensor<'a>(st: &'a SafeTensors, name: &str, dtype: Dtype) -> (&'a [u8], Vec<usize>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(t.dtype(), dtype, "{name}");
    (t.data(), t.shape().to_vec())
}

fn images() -> &'static [Value] {
    fixtures().manifest["images"].as_array().unwrap()
}

fn case(name: &str) -> &'static Value {
    images().iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no image {name}"))
}

/// What transformers' processors start from for this image.
fn expected_rgb(name: &str) -> RgbImage {
    let st = SafeTensors::deserialize(&fixtures().tensors).unwrap();
    let (bytes, shape) = tensor(&st, &format!("rgb/{name}"), Dtype::U8);
    RgbImage::from_raw(shape[1] as u32, shape[0] as u32, bytes.to_vec()).unwrap()
}

fn decode_case(name: &str) -> RgbImage {
    decode_image(&read(case(name)["file"].as_str().unwrap()), &ImageLimits::default())
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn max_level_diff(a: &RgbImage, b: &RgbImage) -> u8 {
    assert_eq!(a.dimensions(), b.dimensions());
    a.as_raw().iter().zip(b.as_raw()).map(|(x, y)| x.abs_diff(*y)).max().unwrap_or(0)
}

fn format_name(f: ImageFormat) -> &'static str {
    match f {
        ImageFormat::Png => "png",
        ImageFormat::Jpeg => "jpeg",
        ImageFormat::Gif => "gif",
        ImageFormat::WebP => "webp",
        ImageFormat::Bmp => "bmp",
    }
}

#[test]
fn decoded_rgb_matches_pil() {
    let mut failures = Vec::new();
    for c in images() {
        let name = c["name"].as_str().unwrap();
        let bytes = read(c["file"].as_str().unwrap());
        let header = image_header(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        let want =
            (c["format"].as_str().unwrap(), c["width"].as_u64().unwrap() as u32, c["height"].as_u64().unwrap() as u32);
        if (format_name(header.format), header.width, header.height) != want {
            failures.push(format!("{name}: header {header:?}, want {want:?}"));
            continue;
        }
        let ours = match decode_image(&bytes, &ImageLimits::default()) {
            Ok(img) => img,
            Err(e) => {
                failures.push(format!("{name}: {e}"));
                continue;
            }
        };
        let theirs = expected_rgb(name);
        if ours.dimensions() != theirs.dimensions() {
            failures.push(format!("{name}: decoded {:?}, PIL {:?}", ours.dimensions(), theirs.dimensions()));
            continue;
        }
        let diff = max_level_diff(&ours, &theirs);
        let tol = c["tol"].as_u64().unwrap() as u8;
        let differing = ours.as_raw().iter().zip(theirs.as_raw()).filter(|(a, b)| a != b).count();
        println!("{name:28} max level diff {diff} ({differing} of {} values differ)", ours.as_raw().len());
        if diff > tol {
            failures.push(format!("{name}: max level difference {diff} > {tol}"));
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

/// transformers' pixel values of one run, rebuilt bit for bit from the stored levels (for
/// Qwen2-VL, `[patches, 3, patch²]`: the temporal copies are expanded here).
fn expected_values(config: &str, image: &str) -> (Vec<f32>, Vec<usize>) {
    let st = SafeTensors::deserialize(&fixtures().tensors).unwrap();
    let (table, _) = tensor(&st, &format!("table/{config}"), Dtype::F32);
    let table: Vec<f32> = table.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    let (levels, shape) = tensor(&st, &format!("levels/{config}/{image}"), Dtype::U8);
    let value = |c: usize, l: u8| table[c * 256 + usize::from(l)];
    if shape.len() == 3 {
        let per_channel = levels.len() / 3;
        return (levels.iter().enumerate().map(|(i, &l)| value(i / per_channel, l)).collect(), shape);
    }
    let temporal = config_value(config, "temporal_patch_size").unwrap_or(2) as usize;
    let per_channel = shape[1] / 3;
    let values = levels
        .chunks_exact(shape[1])
        .flat_map(|row| {
            row.chunks_exact(per_channel)
                .enumerate()
                .flat_map(move |(c, ch)| std::iter::repeat_n(ch, temporal).flatten().map(move |&l| value(c, l)))
        })
        .collect();
    (values, vec![shape[0], shape[1] * temporal])
}

fn config_value(config: &str, key: &str) -> Option<u64> {
    fixtures().manifest["configs"][config][key].as_u64()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn config(name: &str) -> &'static Value {
    &fixtures().manifest["configs"][name]
}

#[test]
fn processors_match_transformers() {
    let mut failures = Vec::new();
    for run in fixtures().manifest["runs"].as_array().unwrap() {
        let (cfg_name, image) = (run["config"].as_str().unwrap(), run["image"].as_str().unwrap());
        let processor = ImageProcessor::from_json(config(cfg_name)).unwrap();
        let (theirs, shape) = expected_values(cfg_name, image);
        let lossy = case(image)["tol"].as_u64().unwrap() > 0;
        // From PIL's own RGB: the processor alone, which must be exact.
        let from_pil = processor.preprocess(&expected_rgb(image)).unwrap();
        // From our decode: exact for lossless formats.
        let ours = processor.preprocess(&decode_case(image)).unwrap();
        assert_eq!(ours.shape(), shape, "{cfg_name}/{image}");
        let (err_pil, err_ours) =
            (max_abs_diff(from_pil.pixel_values(), &theirs), max_abs_diff(ours.pixel_values(), &theirs));
        println!("{cfg_name:14} {image:24} {shape:?}: from PIL's RGB {err_pil:e}, from our decode {err_ours:e}");
        if err_pil > 1e-6 || (!lossy && err_ours > 1e-6) {
            failures.push(format!("{cfg_name}/{image}: {err_pil} / {err_ours}"));
        }
        if let ImagePixels::Qwen2Vl(q) = &ours {
            let grid: Vec<u32> =
                run["grid_thw"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            assert_eq!(q.grid_thw.to_vec(), grid, "{cfg_name}/{image}");
            let header = image_header(&read(case(image)["file"].as_str().unwrap())).unwrap();
            let tokens = processor.num_tokens(header.width, header.height).unwrap();
            assert_eq!(tokens, Some(run["tokens"].as_u64().unwrap() as usize), "{cfg_name}/{image}");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn smart_resize_matches_python() {
    let rows = fixtures().manifest["smart_resize"].as_array().unwrap();
    assert!(rows.len() > 1000);
    for row in rows {
        let n = |i: usize| row[i].as_u64();
        let (h, w, factor, lo, hi) = (n(0).unwrap(), n(1).unwrap(), n(2).unwrap(), n(3).unwrap(), n(4).unwrap());
        let ours = smart_resize(h as u32, w as u32, factor as u32, lo, hi);
        match (n(5), n(6)) {
            (Some(rh), Some(rw)) => assert_eq!(ours, Ok((rh as u32, rw as u32)), "{row}"),
            _ => assert!(matches!(ours, Err(MediaError::AspectRatio { .. })), "{row}: {ours:?}"),
        }
    }
}

#[test]
fn qwen_configs_and_the_fixture() {
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../../shared/fixtures/models/qwen2_vl/preprocessor_config.json"),
        )
        .unwrap_or_else(|_| config("qwen2_vl").to_string()),
    )
    .unwrap();
    let p = Qwen2VlImageProcessor::from_json(&fixture).unwrap();
    assert_eq!(p.smart_resize(80, 100).unwrap(), (84, 112));
    assert_eq!(p.grid_thw(80, 100).unwrap(), [1, 6, 8]);
    assert_eq!(p.num_tokens(80, 100).unwrap(), 12);
    // min/max_pixels and size {shortest_edge, longest_edge} are the same thing.
    let a = Qwen2VlImageProcessor::from_json(config("qwen_small_max")).unwrap();
    let b = Qwen2VlImageProcessor::from_json(config("qwen_size_dict")).unwrap();
    assert_eq!(a.fingerprint(), b.fingerprint());
    assert_ne!(a.fingerprint(), p.fingerprint());
    // Top-level bounds win over `size`.
    let mut cfg = config("qwen_size_dict").clone();
    cfg["min_pixels"] = 100.into();
    assert_eq!(Qwen2VlImageProcessor::from_json(&cfg).unwrap().pixel_bounds(), (100, 6272));
    for bad in [
        serde_json::json!({"size": {"min_pixels": 3136, "max_pixels": 6272}}),
        serde_json::json!({"size": {"shortest_edge": 3136}}),
        serde_json::json!({"min_pixels": 0}),
        serde_json::json!({"patch_size": 0}),
        serde_json::json!({"resample": 2}),
        serde_json::json!({"image_processor_type": "CLIPImageProcessor"}),
        serde_json::json!({"merge_size": "2"}),
    ] {
        assert!(matches!(Qwen2VlImageProcessor::from_json(&bad), Err(MediaError::BadConfig(_))), "{bad}");
    }
    // Aspect ratio above 200 is refused, from the header size alone.
    assert!(matches!(p.num_tokens(1, 201), Err(MediaError::AspectRatio { .. })));
    assert_eq!(p.num_tokens(1, 200).unwrap(), 29);
    // The enum picks the processor from the type.
    assert!(matches!(ImageProcessor::from_json(&fixture), Ok(ImageProcessor::Qwen2Vl(_))));
    let llava = ImageProcessor::from_json(config("llava_tiny")).unwrap();
    assert!(matches!(llava, ImageProcessor::Clip(_)));
    assert_eq!(llava.num_tokens(80, 64).unwrap(), None);
    assert_eq!(llava.fingerprint(), ClipImageProcessor::from_json(config("llava_tiny")).unwrap().fingerprint());
    assert!(ImageProcessor::from_json(&serde_json::json!({"image_processor_type": "SiglipImageProcessor"})).is_err());
    assert!(ImageProcessor::from_json(&serde_json::json!({})).is_err());
}

/// Truncated files of every format: refused wherever transformers' loader refuses them, and
/// never a panic at any cut.
#[test]
fn truncated_files_are_errors() {
    let mut lenient = Vec::new();
    for c in images() {
        let name = c["name"].as_str().unwrap();
        let bytes = read(c["file"].as_str().unwrap());
        for t in c["truncated"].as_array().unwrap() {
            let (cut, pil_ok) = (t[0].as_u64().unwrap() as usize, t[1].as_bool().unwrap());
            let ours = decode_image(&bytes[..cut], &ImageLimits::default());
            match (pil_ok, &ours) {
                (false, Ok(_)) => panic!("{name} cut at {cut} of {}: decoded, PIL refuses it", bytes.len()),
                (true, Err(e)) => lenient.push(format!("{name}[..{cut}]: {e}")),
                _ => {}
            }
        }
        for cut in (0..bytes.len()).step_by(bytes.len() / 97 + 1) {
            let _ = image_header(&bytes[..cut]);
            let _ = decode_image(&bytes[..cut], &ImageLimits::default());
        }
    }
    println!("truncated files PIL accepts and we refuse ({}):\n{}", lenient.len(), lenient.join("\n"));
}

/// Corrupted bytes (flipped here and there): an error or an image, never a panic.
#[test]
fn corrupted_files_do_not_panic() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    // MMSERVE_FUZZ_ROUNDS=2000 for a longer run.
    let rounds = std::env::var("MMSERVE_FUZZ_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    for c in images() {
        let bytes = read(c["file"].as_str().unwrap());
        for _ in 0..rounds {
            let mut b = bytes.clone();
            // Half the time in the first 100 bytes, where the headers are.
            let span = if next() % 2 == 0 { b.len().min(100) } else { b.len() } as u64;
            for _ in 0..1 + next() % 4 {
                let i = (next() % span) as usize;
                b[i] = next() as u8;
            }
            let _ = image_header(&b);
            let _ = decode_image(&b, &ImageLimits { max_pixels: 1 << 22 });
        }
    }
}
