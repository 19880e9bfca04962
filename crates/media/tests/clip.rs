use image::Rgb;
use mmserve_media::{ClipImageProcessor, MediaError, RgbImage, resize_bicubic};
use serde_json::{Value, json};

fn clip(size: Value, crop: Value) -> ClipImageProcessor {
    ClipImageProcessor::from_json(&json!({
        "image_processor_type": "CLIPImageProcessor",
        "size": size, "crop_size": crop, "resample": 3,
    }))
    .unwrap()
}

fn pattern(w: u32, h: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| Rgb([(x * 7 + y * 3) as u8, (x * y) as u8, (x + 2 * y).wrapping_neg() as u8]))
}

/// The straightforward way: full resize, crop with zero padding, rescale, normalise.
fn naive(img: &RgbImage, (rw, rh): (u32, u32), (cw, ch): (u32, u32)) -> Vec<f32> {
    let full = resize_bicubic(img, rw, rh);
    let (mean, std) = (
        [0.48145466f64, 0.4578275, 0.40821073].map(|x| x as f32),
        [0.26862954f64, 0.26130258, 0.27577711].map(|x| x as f32),
    );
    let top = (i64::from(rh) - i64::from(ch)).div_euclid(2);
    let left = (i64::from(rw) - i64::from(cw)).div_euclid(2);
    let mut out = Vec::new();
    for c in 0..3 {
        for y in 0..i64::from(ch) {
            for x in 0..i64::from(cw) {
                let (sy, sx) = (y + top, x + left);
                let inside = (0..i64::from(rh)).contains(&sy) && (0..i64::from(rw)).contains(&sx);
                let level = if inside { full.get_pixel(sx as u32, sy as u32)[c] } else { 0 };
                out.push(((f64::from(level) * (1.0 / 255.0)) as f32 - mean[c]) / std[c]);
            }
        }
    }
    out
}

#[test]
fn defaults_are_clip_224() {
    let p = ClipImageProcessor::from_json(&json!({})).unwrap();
    assert_eq!(p.output_size(), (224, 224));
    assert_eq!(p, clip(json!({"shortest_edge": 224}), json!({"height": 224, "width": 224})));
    assert_eq!(p, clip(json!(224), json!(224)));
}

#[test]
fn elongated_image_crop_window_is_exact() {
    // 3×400: the full resize would be 8×1066; only the 8×8 centre is computed.
    let p = clip(json!({"shortest_edge": 8}), json!({"height": 8, "width": 8}));
    let img = pattern(3, 400);
    assert_eq!(p.preprocess(&img).unwrap(), naive(&img, (8, 1066), (8, 8)));
    let img = pattern(401, 5);
    assert_eq!(p.preprocess(&img).unwrap(), naive(&img, (641, 8), (8, 8)));
}

#[test]
fn very_elongated_image_is_cheap() {
    // transformers would resize 1×4000 to 336×1,344,000 first.
    let p = clip(json!({"shortest_edge": 336}), json!(336));
    let img = pattern(1, 4000);
    let out = p.preprocess(&img).unwrap();
    assert_eq!(out.len(), 3 * 336 * 336);
}

#[test]
fn crop_larger_than_image_pads_with_zero() {
    let p = clip(json!({"height": 5, "width": 9}), json!({"height": 8, "width": 6}));
    let img = pattern(13, 7);
    let out = p.preprocess(&img).unwrap();
    assert_eq!(out, naive(&img, (9, 5), (6, 8)));
    let zero = (0.0 - 0.48145466f64 as f32) / 0.26862954f64 as f32;
    assert_eq!(out[0], zero);
    assert_ne!(out[2 * 6 + 1], zero);
}

#[test]
fn no_resize_no_rescale_no_normalize_is_raw_levels() {
    let p = ClipImageProcessor::from_json(&json!({
        "do_resize": false, "crop_size": {"height": 2, "width": 3},
        "do_rescale": false, "do_normalize": false,
    }))
    .unwrap();
    let img = pattern(5, 4);
    let out = p.preprocess(&img).unwrap();
    // top = (4-2)//2 = 1, left = (5-3)//2 = 1
    let expect: Vec<f32> = (0..3)
        .flat_map(|c| (1..3).flat_map(move |y| (1..4).map(move |x| (c, x, y))))
        .map(|(c, x, y)| f32::from(img.get_pixel(x, y)[c]))
        .collect();
    assert_eq!(out, expect);
}

#[test]
fn bad_configs_refused() {
    let cases = [
        json!({"resample": 2}),
        json!({"image_processor_type": "Qwen2VLImageProcessor"}),
        json!({"size": {"shortest_edge": 0}}),
        json!({"size": {"shortest_edge": 10, "longest_edge": 20}}),
        json!({"size": "big"}),
        json!({"crop_size": {"height": 4}}),
        json!({"do_center_crop": false}),
        json!({"image_std": [1.0, 0.0, 1.0]}),
        json!({"image_mean": [1.0, 2.0]}),
        json!({"do_resize": "yes"}),
        json!([1, 2]),
    ];
    for cfg in cases {
        let err = ClipImageProcessor::from_json(&cfg).unwrap_err();
        assert!(matches!(err, MediaError::BadConfig(_)), "{cfg}: {err:?}");
    }
    let p =
        ClipImageProcessor::from_json(&json!({"do_center_crop": false, "size": {"height": 3, "width": 4}})).unwrap();
    assert_eq!(p.output_size(), (3, 4));
}

#[test]
fn zero_sized_image_refused() {
    let err = clip(json!(4), json!(4)).preprocess(&RgbImage::new(0, 3)).unwrap_err();
    assert_eq!(err, MediaError::ZeroSized);
}

#[test]
fn fingerprint_is_canonical() {
    let a = clip(json!({"shortest_edge": 336}), json!(336));
    let b = clip(json!(336), json!({"height": 336, "width": 336}));
    assert_eq!(a.fingerprint(), b.fingerprint());
    assert_eq!(
        a.fingerprint(),
        "clip-pil-v1;convert_rgb=true;resize=shortest_edge:336;resample=bicubic;crop=336x336;\
         rescale=0.00392156862745098;normalize=mean[0.48145467, 0.4578275, 0.40821072]std[0.26862955, 0.2613026, 0.2757771]"
    );
    let variants = [
        json!({"size": {"shortest_edge": 335}}),
        json!({"crop_size": 335}),
        json!({"rescale_factor": 0.004}),
        json!({"do_rescale": false}),
        json!({"do_normalize": false}),
        json!({"image_mean": 0.5}),
        json!({"image_std": [0.26862954, 0.26130258, 0.2757772]}),
        json!({"size": {"height": 336, "width": 336}}),
    ];
    let mut seen = std::collections::HashSet::from([a.fingerprint()]);
    for v in variants {
        let mut cfg = json!({"size": {"shortest_edge": 336}, "crop_size": 336});
        cfg.as_object_mut().unwrap().extend(v.as_object().unwrap().clone());
        let fp = ClipImageProcessor::from_json(&cfg).unwrap().fingerprint();
        assert!(seen.insert(fp.clone()), "{cfg} gives a duplicate fingerprint {fp}");
    }
}
