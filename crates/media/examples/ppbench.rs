//! Times decoding and preprocessing separately, one thread:
//! `cargo run --release -p mmserve-media --example ppbench -- CONFIG FILES...`.

use std::time::Instant;

use mmserve_media::{
    ImageLimits, ImageProcessor,
    audio::{AudioLimits, WhisperFeatureExtractor, decode_audio},
    decode_image,
};

fn best<T>(n: usize, mut f: impl FnMut() -> T) -> f64 {
    std::hint::black_box(f());
    (0..n)
        .map(|_| {
            let t0 = Instant::now();
            std::hint::black_box(f());
            t0.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&args[0]).unwrap()).unwrap();
    let n: usize = std::env::var("N").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
    for file in &args[1..] {
        let bytes = std::fs::read(file).unwrap();
        if file.ends_with(".wav") {
            let fe = WhisperFeatureExtractor::from_json(&cfg).unwrap();
            let wave = decode_audio(&bytes, None, &AudioLimits::default()).unwrap();
            let d = best(n, || decode_audio(&bytes, None, &AudioLimits::default()).unwrap());
            let e = best(n, || fe.extract(&wave.samples));
            println!("{file:<28} decode {:8.3} ms  extract {:8.3} ms", d * 1e3, e * 1e3);
        } else {
            let p = ImageProcessor::from_json(&cfg).unwrap();
            let img = decode_image(&bytes, &ImageLimits::default()).unwrap();
            let d = best(n, || decode_image(&bytes, &ImageLimits::default()).unwrap());
            let e = best(n, || p.preprocess(&img).unwrap());
            println!(
                "{file:<28} decode {:8.3} ms  preprocess {:8.3} ms  total {:8.3}",
                d * 1e3,
                e * 1e3,
                (d + e) * 1e3
            );
        }
    }
}
