//! Whisper log-mel features, as transformers' `WhisperFeatureExtractor` computes them.
//!
//! For 16 kHz mono samples: pad with `padding_value` (or truncate) to `n_samples` (30 s), reflect-pad
//! by `n_fft / 2` on both sides (a centred STFT), frame with hop `hop_length` and a periodic Hann
//! window, take the power spectrum `|X|²`, apply a Slaney-normalised, Slaney-scale mel filter bank
//! (0 to 8000 Hz), clamp at 1e-10, take `log10`, drop the last frame, then `max(x, max − 8)` and
//! `(x + 4) / 4` with the maximum taken over the whole 30 s window (padding included).
//!
//! Clips longer than `n_samples` are truncated: transformers' Qwen2-Audio processor calls the
//! extractor with `padding="max_length"` and its default `truncation=True`, so everything after
//! the first 30 s is silently dropped and the features always have `nb_max_frames` (3000) frames.
//! The attention mask marks `ceil(samples / hop_length)` frames (at most `nb_max_frames`).
//!
//! Everything runs in `f32`, as transformers' torch path does (its numpy path uses `f64` for the
//! spectrum and filter bank; the two are 2.3e-5 apart on the fixture). The filter bank is built
//! in `f64` with transformers' arithmetic order and rounded once. Measured: 3.2e-5 from the
//! fixture (torch path); from the numpy path 3.0e-5 on tones, 4.9e-5 on brown noise (the widest
//! spectral range, where f32 FFT rounding shows most), 2.9e-6 on white noise.

use std::sync::Arc;

use realfft::num_complex::Complex;
use realfft::{RealFftPlanner, RealToComplex};
use serde_json::Value;

use super::AudioError;
use super::stft::{LANES, Stft};

/// The values a log-mel bin is clamped to before `log10`.
const MEL_FLOOR: f32 = 1e-10;

/// transformers' `WhisperFeatureExtractor` (numpy/torch feature path; `dither` 0, no
/// `do_normalize`), built from `preprocessor_config.json`.
#[derive(Clone)]
pub struct WhisperFeatureExtractor {
    /// Mel bins (80 or 128).
    pub feature_size: usize,
    pub sampling_rate: u32,
    pub hop_length: usize,
    pub n_fft: usize,
    pub chunk_length: usize,
    /// Samples in the window: `chunk_length · sampling_rate`.
    pub n_samples: usize,
    /// Feature frames: `n_samples / hop_length`.
    pub nb_max_frames: usize,
    pub padding_value: f32,
    pub return_attention_mask: bool,
    window: Vec<f32>,
    filters: Vec<MelFilter>,
    /// `filters` in `f32`: each filter's first bin, and its weights.
    filters32: Vec<(usize, Vec<f32>)>,
    /// The vertical STFT where `n_fft` suits it (Whisper's 400 does), else one frame at a
    /// time through realfft.
    spectra: Spectra,
}

#[derive(Clone)]
enum Spectra {
    Vertical(Stft),
    PerFrame(Arc<dyn RealToComplex<f32>>),
}

impl std::fmt::Debug for WhisperFeatureExtractor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WhisperFeatureExtractor")
            .field("feature_size", &self.feature_size)
            .field("sampling_rate", &self.sampling_rate)
            .field("hop_length", &self.hop_length)
            .field("n_fft", &self.n_fft)
            .field("n_samples", &self.n_samples)
            .field("nb_max_frames", &self.nb_max_frames)
            .finish_non_exhaustive()
    }
}

/// One triangular mel filter: its weights over the FFT bins `start..start + weights.len()`.
#[derive(Debug, Clone, PartialEq)]
pub struct MelFilter {
    pub start: usize,
    pub weights: Vec<f64>,
}

/// Log-mel features of one clip.
#[derive(Debug, Clone, PartialEq)]
pub struct Features {
    /// `[n_mels, n_frames]`, row-major.
    pub input_features: Vec<f32>,
    /// `[n_frames]`: 1 for the frames that hold audio, then 0.
    pub attention_mask: Vec<i32>,
    /// The number of ones in `attention_mask`.
    pub valid_frames: usize,
    pub n_mels: usize,
    pub n_frames: usize,
    /// Samples used (the input, truncated to `n_samples`).
    pub samples: usize,
}

impl WhisperFeatureExtractor {
    /// Reads `preprocessor_config.json`. Missing fields take transformers' defaults (80 mels,
    /// 16 kHz, hop 160, `n_fft` 400, 30 s, padding 0). `n_samples` and `nb_max_frames`, when given,
    /// must agree with the values derived from the others.
    pub fn from_json(config: &Value) -> Result<Self, AudioError> {
        let bad = |m: String| AudioError::BadConfig(m);
        let uint = |key: &str, default: usize| -> Result<usize, AudioError> {
            match config.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v.as_u64().map(|v| v as usize).ok_or_else(|| bad(format!("`{key}` is not a whole number"))),
            }
        };
        let float = |key: &str, default: f64| -> Result<f64, AudioError> {
            match config.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v.as_f64().ok_or_else(|| bad(format!("`{key}` is not a number"))),
            }
        };
        if let Some(kind) = config.get("feature_extractor_type").and_then(Value::as_str)
            && kind != "WhisperFeatureExtractor"
        {
            return Err(bad(format!("feature extractor `{kind}` is not implemented (only WhisperFeatureExtractor)")));
        }
        if let Some(side) = config.get("padding_side").and_then(Value::as_str)
            && side != "right"
        {
            return Err(bad(format!("padding_side `{side}` is not implemented (only \"right\")")));
        }
        if float("dither", 0.0)? != 0.0 {
            return Err(bad("a non-zero `dither` is not implemented".into()));
        }
        if config.get("do_normalize").and_then(Value::as_bool) == Some(true) {
            return Err(bad("`do_normalize` is not implemented".into()));
        }
        let feature_size = uint("feature_size", 80)?;
        let sampling_rate = uint("sampling_rate", 16_000)?;
        let hop_length = uint("hop_length", 160)?;
        let n_fft = uint("n_fft", 400)?;
        let chunk_length = uint("chunk_length", 30)?;
        let padding_value = float("padding_value", 0.0)? as f32;
        let return_attention_mask = config.get("return_attention_mask").and_then(Value::as_bool).unwrap_or(false);
        if sampling_rate != 16_000 {
            return Err(bad(format!("sampling_rate {sampling_rate} is not supported (only 16000)")));
        }
        if !(1..=1024).contains(&feature_size) || hop_length == 0 || !(2..=1 << 16).contains(&n_fft) {
            return Err(bad(format!("feature_size {feature_size}, hop_length {hop_length}, n_fft {n_fft}")));
        }
        if !(1..=600).contains(&chunk_length) {
            return Err(bad(format!("chunk_length {chunk_length} is out of range (1..=600 s)")));
        }
        let n_samples = chunk_length * sampling_rate;
        let nb_max_frames = n_samples / hop_length;
        if n_fft / 2 >= n_samples || nb_max_frames == 0 {
            return Err(bad(format!("n_fft {n_fft} and hop_length {hop_length} do not fit {chunk_length} s")));
        }
        for (key, derived) in [("n_samples", n_samples), ("nb_max_frames", nb_max_frames)] {
            let stated = uint(key, derived)?;
            if stated != derived {
                return Err(bad(format!("`{key}` is {stated}, but the other fields give {derived}")));
            }
        }
        let window =
            (0..n_fft).map(|i| (0.5 - 0.5 * (std::f64::consts::TAU * i as f64 / n_fft as f64).cos()) as f32).collect();
        let filters = mel_filter_bank(n_fft / 2 + 1, feature_size, 0.0, 8000.0, sampling_rate as f64);
        let filters32 = filters.iter().map(|f| (f.start, f.weights.iter().map(|&w| w as f32).collect())).collect();
        let spectra = match Stft::new(n_fft) {
            Some(stft) => Spectra::Vertical(stft),
            None => Spectra::PerFrame(RealFftPlanner::<f32>::new().plan_fft_forward(n_fft)),
        };
        Ok(Self {
            feature_size,
            sampling_rate: sampling_rate as u32,
            hop_length,
            n_fft,
            chunk_length,
            n_samples,
            nb_max_frames,
            padding_value,
            return_attention_mask,
            window,
            filters,
            filters32,
            spectra,
        })
    }

    /// The mel filter bank, one sparse filter per mel bin.
    pub fn mel_filters(&self) -> &[MelFilter] {
        &self.filters
    }

    /// Log-mel features of 16 kHz mono `samples` (truncated or padded to `n_samples`).
    pub fn extract(&self, samples: &[f32]) -> Features {
        let (n_fft, hop, n_frames, n_mels) = (self.n_fft, self.hop_length, self.nb_max_frames, self.feature_size);
        let used = samples.len().min(self.n_samples);
        let pad = n_fft / 2;
        let samples = &samples[..used];
        let padding = self.padding_value;

        // The padded window x: the clip padded with `padding_value` to `n_samples`, then
        // reflect-padded by n_fft / 2 on both sides (numpy's "reflect": the edge sample is not
        // repeated). Frames that lie inside the clip are read from `samples` in place; the few
        // that reach into the padding are copied out through `padded`.
        let n = self.n_samples;
        let signal = |j: usize| if j < used { samples[j] } else { padding };
        let padded = |i: usize| {
            if i < pad {
                signal(pad - i)
            } else if i < pad + n {
                signal(i - pad)
            } else {
                signal(2 * n - 2 - (i - pad))
            }
        };
        // Positions of x that may be nonzero (a hull): frames outside it have a zero spectrum
        // and are not transformed (the padding of a short clip).
        let maybe_nonzero = if padding != 0.0 {
            0..n + 2 * pad
        } else {
            match (samples.iter().position(|&v| v != 0.0), samples.iter().rposition(|&v| v != 0.0)) {
                (Some(first), Some(last)) => {
                    let lo = if first <= pad { 0 } else { first + pad };
                    let hi = if last + 1 + pad >= n { n + 2 * pad } else { last + pad + 1 };
                    lo..hi
                }
                _ => 0..0,
            }
        };

        let bins = n_fft / 2 + 1;
        // Frames go in tiles of TILE, each frame's power spectrum stored bin-major in the tile
        // ([bin][frame], in L1): the vertical STFT writes that layout directly, and every
        // mel's weighted sum then runs over the tile's frames in SIMD lanes and lands as a
        // contiguous run of the [n_mels, n_frames] output.
        let mut tile = vec![0f32; bins * TILE];
        let mut out = vec![0f32; n_mels * n_frames];
        let mut edges = vec![0f32; TILE * n_fft];
        let mut scratch = None;
        // A frame starting at `at` lies inside the clip: read in place.
        let inside = |at: usize| at >= pad && at + n_fft <= pad + used;
        for t0 in (0..n_frames).step_by(TILE) {
            let width = TILE.min(n_frames - t0);
            let starts = (t0..t0 + width).map(|t| t * hop);
            if starts.clone().all(|at| at >= maybe_nonzero.end || at + n_fft <= maybe_nonzero.start) {
                tile.fill(0.0);
            } else {
                // Copies of the frames that reach into the padding first, then borrows.
                for (f, at) in starts.clone().enumerate() {
                    if !inside(at) {
                        for (k, v) in edges[f * n_fft..][..n_fft].iter_mut().enumerate() {
                            *v = padded(at + k);
                        }
                    }
                }
                let mut group: [&[f32]; TILE] = [&[]; TILE];
                for (f, at) in starts.enumerate() {
                    group[f] = if inside(at) { &samples[at - pad..][..n_fft] } else { &edges[f * n_fft..][..n_fft] };
                }
                let frames = &group[..width];
                match &self.spectra {
                    Spectra::Vertical(stft) => {
                        let scratch = scratch.get_or_insert_with(|| stft.scratch());
                        stft.power_spectra(frames, &self.window, scratch, &mut tile);
                    }
                    Spectra::PerFrame(fft) => self.per_frame(fft.as_ref(), frames, &mut tile),
                }
            }
            mel_tile(&tile, &self.filters32, &mut out[t0..], n_frames, width);
        }
        let floor = largest(&out) - 8.0;
        for v in &mut out {
            *v = (v.max(floor) + 4.0) / 4.0;
        }

        let valid_frames = self.valid_frames(used);
        let attention_mask = (0..n_frames).map(|t| i32::from(t < valid_frames)).collect();
        Features { input_features: out, attention_mask, valid_frames, n_mels, n_frames, samples: used }
    }

    /// Power spectra one frame at a time (an `n_fft` the vertical STFT does not take), into
    /// the tile's layout; lanes past `frames` come out zero.
    fn per_frame(&self, fft: &dyn RealToComplex<f32>, frames: &[&[f32]], tile: &mut [f32]) {
        let mut frame = fft.make_input_vec();
        let mut spectrum = fft.make_output_vec();
        let mut scratch = fft.make_scratch_vec();
        tile.fill(0.0);
        for (j, src) in frames.iter().enumerate() {
            for ((f, &s), &w) in frame.iter_mut().zip(*src).zip(&self.window) {
                *f = s * w;
            }
            fft.process_with_scratch(&mut frame, &mut spectrum, &mut scratch).expect("FFT buffer sizes");
            for (b, c) in spectrum.iter().enumerate() {
                tile[b * TILE + j] = Complex::norm_sqr(c);
            }
        }
    }

    /// Every setting that changes the features, for cache keys.
    pub fn fingerprint(&self) -> String {
        format!(
            "whisper:mels={},rate={},hop={},nfft={},samples={},frames={},pad={}",
            self.feature_size,
            self.sampling_rate,
            self.hop_length,
            self.n_fft,
            self.n_samples,
            self.nb_max_frames,
            self.padding_value
        )
    }

    /// Feature frames that `samples` samples fill (the attention mask's ones), after the
    /// truncation to `n_samples`.
    pub fn valid_frames(&self, samples: usize) -> usize {
        samples.min(self.n_samples).div_ceil(self.hop_length).min(self.nb_max_frames)
    }

    /// Qwen2-Audio's token count for `features`, refusing a clip too short to yield one token
    /// (transformers would silently drop the audio).
    pub fn qwen2_audio_tokens_checked(&self, features: &Features) -> Result<usize, AudioError> {
        self.qwen2_audio_tokens_for(features.samples)
    }

    /// As [`qwen2_audio_tokens_checked`](Self::qwen2_audio_tokens_checked), from the clip's
    /// length in samples (at `sampling_rate`) alone: no features needed.
    pub fn qwen2_audio_tokens_for(&self, samples: usize) -> Result<usize, AudioError> {
        match qwen2_audio_tokens(self.valid_frames(samples)) {
            0 => {
                // 3 frames give the first token; they need more than 2 hops of samples.
                let rate = f64::from(self.sampling_rate);
                Err(AudioError::TooShort {
                    seconds: samples.min(self.n_samples) as f64 / rate,
                    min_seconds: (2 * self.hop_length + 1) as f64 / rate,
                })
            }
            n => Ok(n),
        }
    }
}

/// Qwen2-Audio's audio tokens for `valid_frames` feature frames: the model's rule.
pub use mmserve_config::audio_token_count as qwen2_audio_tokens;

/// Frames per tile of [`WhisperFeatureExtractor::extract`]: one group of the vertical STFT.
const TILE: usize = LANES;

crate::simd::dispatch!(
    /// log10(max(Σ weights · power, floor)) of every mel over a tile's frames: mel `m`'s
    /// `width` values land at `out[m * stride..]`. One call a tile, not one a mel: a mel's
    /// span is a few bins, less work than a call.
    mel_tile(tile: &[f32], filters: &[(usize, Vec<f32>)], out: &mut [f32], stride: usize, width: usize) -> ()
        => mel_tile_kernel
);

#[inline(always)]
fn mel_tile_kernel(tile: &[f32], filters: &[(usize, Vec<f32>)], out: &mut [f32], stride: usize, width: usize) {
    // The sums first, each mel's in its own row of `sums` (L1, 128 mels at a time), then the
    // logs a row at a time: loops the vectoriser keeps in registers, which one loop doing
    // both did not (its accumulators went through the stack).
    const CHUNK: usize = 128;
    for (c, chunk) in filters.chunks(CHUNK).enumerate() {
        let mut sums = [[0f32; TILE]; CHUNK];
        for ((start, weights), acc) in chunk.iter().zip(&mut sums) {
            for (b, &w) in weights.iter().enumerate() {
                let row: &[f32; TILE] = tile[(start + b) * TILE..][..TILE].try_into().expect("a tile row");
                for (a, &p) in acc.iter_mut().zip(row) {
                    *a += p * w;
                }
            }
        }
        for (m, acc) in sums[..chunk.len()].iter().enumerate() {
            for (o, &a) in out[(c * CHUNK + m) * stride..][..width].iter_mut().zip(acc) {
                *o = log2_f32(if a > MEL_FLOOR { a } else { MEL_FLOOR }) * std::f32::consts::LOG10_2;
            }
        }
    }
}

crate::simd::dispatch!(
    /// The largest of `xs` (finite values).
    largest(xs: &[f32]) -> f32 => largest_kernel
);

#[inline(always)]
fn largest_kernel(xs: &[f32]) -> f32 {
    // Lane-wise maxima by comparison (maxps), then across lanes: `f32::max`'s NaN rules
    // would keep the loop scalar.
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = xs.chunks_exact(16);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (l, &v) in lanes.iter_mut().zip(chunk) {
            *l = if v > *l { v } else { *l };
        }
    }
    lanes.iter().chain(rest).copied().fold(f32::NEG_INFINITY, f32::max)
}

/// log2 of a positive normal `f32`, within 3e-7 plus the result's own f32 rounding
/// (two ulps) of the exact value: the exponent, plus
/// log2 of the mantissa brought into [√½, √2) from `2·atanh(t)/ln 2`, t = (m−1)/(m+1),
/// |t| ≤ 0.172, by its series to t⁹ (the first term left out is below 2e-9). Plain
/// arithmetic, so loops over it vectorise, unlike calls into libm.
#[inline]
fn log2_f32(x: f32) -> f32 {
    let bits = x.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 127;
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    if m > std::f32::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let t = (m - 1.0) / (m + 1.0);
    let t2 = t * t;
    let series = t * (2.0 + t2 * (2.0 / 3.0 + t2 * (2.0 / 5.0 + t2 * (2.0 / 7.0 + t2 * (2.0 / 9.0)))));
    e as f32 + series * std::f32::consts::LOG2_E
}

fn hertz_to_mel_slaney(hz: f64) -> f64 {
    let (min_log_hz, min_log_mel, logstep) = (1000.0, 15.0, 27.0 / 6.4f64.ln());
    if hz >= min_log_hz { min_log_mel + (hz / min_log_hz).ln() * logstep } else { 3.0 * hz / 200.0 }
}

fn mel_to_hertz_slaney(mel: f64) -> f64 {
    let (min_log_hz, min_log_mel, logstep) = (1000.0, 15.0, 6.4f64.ln() / 27.0);
    if mel >= min_log_mel { min_log_hz * (logstep * (mel - min_log_mel)).exp() } else { 200.0 * mel / 3.0 }
}

/// numpy's `linspace(start, stop, num)`: `i · step + start`, the last value exactly `stop`.
fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    let step = (stop - start) / (num - 1) as f64;
    let mut v: Vec<f64> = (0..num).map(|i| i as f64 * step + start).collect();
    v[num - 1] = stop;
    v
}

/// transformers' `mel_filter_bank(num_frequency_bins, num_mel_filters, min_frequency,
/// max_frequency, sampling_rate, norm="slaney", mel_scale="slaney")` with its arithmetic order,
/// stored sparsely (each filter's non-zero span of FFT bins).
pub fn mel_filter_bank(n_bins: usize, n_mels: usize, fmin: f64, fmax: f64, sampling_rate: f64) -> Vec<MelFilter> {
    let mel = linspace(hertz_to_mel_slaney(fmin), hertz_to_mel_slaney(fmax), n_mels + 2);
    let f: Vec<f64> = mel.into_iter().map(mel_to_hertz_slaney).collect();
    let bins = linspace(0.0, (sampling_rate as u64 / 2) as f64, n_bins);
    (0..n_mels)
        .map(|m| {
            let enorm = 2.0 / (f[m + 2] - f[m]);
            let weight = |hz: f64| {
                let down = -(f[m] - hz) / (f[m + 1] - f[m]);
                let up = (f[m + 2] - hz) / (f[m + 2] - f[m + 1]);
                0.0f64.max(down.min(up)) * enorm
            };
            let nonzero: Vec<usize> = (0..n_bins).filter(|&i| weight(bins[i]) > 0.0).collect();
            match (nonzero.first(), nonzero.last()) {
                (Some(&a), Some(&b)) => MelFilter { start: a, weights: (a..=b).map(|i| weight(bins[i])).collect() },
                _ => MelFilter { start: 0, weights: Vec::new() },
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_log2_is_within_3e_7_plus_rounding() {
        // Powers of two, both sides of √2, the mel floor, and a sweep of 1e-10..1e10.
        let mut worst = 0f64;
        let mut x = 1e-10f64;
        let mut check = |v: f32| {
            let exact = f64::from(v).log2();
            let err = (f64::from(log2_f32(v)) - exact).abs() - 2.0 * f64::from(f32::EPSILON) * exact.abs();
            worst = worst.max(err);
        };
        for v in [1.0f32, 2.0, 0.5, 1024.0, 1.4142134, 1.4142137, 1e-10, 3.0e38] {
            check(v);
        }
        while x < 1e10 {
            check(x as f32);
            x *= 1.000_731;
        }
        assert!(worst < 3e-7, "worst error {worst}");
    }

    fn dense(filters: &[MelFilter], m: usize, bin: usize) -> f64 {
        let f = &filters[m];
        if bin < f.start { 0.0 } else { f.weights.get(bin - f.start).copied().unwrap_or(0.0) }
    }

    #[test]
    fn mel_filters_in_the_linear_region_by_hand() {
        // Below 1 kHz the Slaney scale is linear (mel = 3·hz/200), so the 130 edges are spaced
        // Δ = (200/3)·mel(8000)/129 Hz apart, mel(8000) = 15 + 27·ln 8 / ln 6.4. Filter 0 spans
        // (0, 2Δ) with its peak at Δ ≈ 23.4 Hz; the only FFT bin inside is bin 1 (40 Hz), on the
        // falling side: (2Δ − 40)/Δ, times the Slaney norm 2/(2Δ).
        let filters = mel_filter_bank(201, 128, 0.0, 8000.0, 16000.0);
        let delta = 200.0 / 3.0 * (15.0 + 27.0 * 8f64.ln() / 6.4f64.ln()) / 129.0;
        assert_eq!(filters[0], MelFilter { start: 1, weights: vec![filters[0].weights[0]] });
        let by_hand = (2.0 * delta - 40.0) / delta / delta;
        assert!((filters[0].weights[0] - by_hand).abs() < 1e-15, "{} vs {by_hand}", filters[0].weights[0]);
        // Filter m (m + 2 edges below 1 kHz) at bin i: min(rising, falling) · 1/Δ.
        for m in 0..30 {
            for bin in 0..30 {
                let hz = 40.0 * bin as f64;
                let (lo, mid, hi) = (m as f64 * delta, (m + 1) as f64 * delta, (m + 2) as f64 * delta);
                let tri = ((hz - lo) / (mid - lo)).min((hi - hz) / (hi - mid)).max(0.0) / delta;
                assert!((dense(&filters, m, bin) - tri).abs() < 1e-12, "mel {m} bin {bin}");
            }
        }
    }

    #[test]
    fn mel_filters_match_transformers() {
        // transformers 5.24 `mel_filter_bank(201, n, 0, 8000, 16000, "slaney", "slaney")`.
        let f128 = mel_filter_bank(201, 128, 0.0, 8000.0, 16000.0);
        let f80 = mel_filter_bank(201, 80, 0.0, 8000.0, 16000.0);
        let known = [
            (&f128, 0, 1, 0.012373986332636965),
            (&f128, 1, 1, 0.03039256487135522),
            (&f128, 64, 42, 0.006749682704665422),
            (&f128, 64, 43, 0.01809151762107613),
            (&f128, 127, 191, 0.00047569508346930465),
            (&f128, 127, 193, 0.002758648379246973),
            (&f80, 0, 1, 0.024862593984176087),
            (&f80, 1, 2, 0.022871772096078023),
            (&f80, 40, 43, 0.014735565741439168),
            (&f80, 79, 186, 0.00036674167978492585),
        ];
        for (filters, m, bin, value) in known {
            let ours = dense(filters, m, bin);
            assert!(
                (ours - value).abs() <= 1e-13 * value,
                "{} mels: mel {m} bin {bin}: {ours} vs {value}",
                filters.len()
            );
        }
        assert_eq!((f128[64].start, f128[64].weights.len(), f128[127].start, f128[127].weights.len()), (42, 2, 191, 9));
        assert_eq!((f80[40].start, f80[40].weights.len(), f80[79].start, f80[79].weights.len()), (42, 3, 186, 14));
    }

    #[test]
    fn slaney_norm_gives_unit_area() {
        // Each triangle has area 1 (in Hz); sampled every 40 Hz, the wide ones (7-9 bins) sum to
        // 1/40 within the sampling error.
        for m in 100..128 {
            let f = &mel_filter_bank(201, 128, 0.0, 8000.0, 16000.0)[m];
            let area = 40.0 * f.weights.iter().sum::<f64>();
            assert!((area - 1.0).abs() < 0.02, "mel {m}: {area}");
        }
    }

    /// The features the old way: the padded window materialised, every frame through realfft.
    fn per_frame_reference(fe: &WhisperFeatureExtractor, samples: &[f32]) -> Vec<f32> {
        let (n_fft, pad, n) = (fe.n_fft, fe.n_fft / 2, fe.n_samples);
        let used = samples.len().min(n);
        let mut x = vec![fe.padding_value; n + 2 * pad];
        x[pad..pad + used].copy_from_slice(&samples[..used]);
        for k in 1..=pad {
            x[pad - k] = x[pad + k];
            x[pad + n - 1 + k] = x[pad + n - 1 - k];
        }
        let fft = RealFftPlanner::<f32>::new().plan_fft_forward(n_fft);
        let mut out = vec![0f32; fe.feature_size * fe.nb_max_frames];
        for t in 0..fe.nb_max_frames {
            let mut frame: Vec<f32> =
                x[t * fe.hop_length..][..n_fft].iter().zip(&fe.window).map(|(a, w)| a * w).collect();
            let mut spectrum = fft.make_output_vec();
            fft.process(&mut frame, &mut spectrum).unwrap();
            for (m, (start, weights)) in fe.filters32.iter().enumerate() {
                let e: f32 = weights.iter().enumerate().map(|(b, w)| w * spectrum[start + b].norm_sqr()).sum();
                out[m * fe.nb_max_frames + t] = e.max(MEL_FLOOR).log10();
            }
        }
        let floor = out.iter().cloned().fold(f32::NEG_INFINITY, f32::max) - 8.0;
        out.iter().map(|v| (v.max(floor) + 4.0) / 4.0).collect()
    }

    #[test]
    fn frames_read_in_place_match_the_materialised_window() {
        // A whole window (the end reflection inside the clip), a short clip (the padding), a
        // clip starting with silence, and a nonzero padding value (no frame skipped).
        let fe =
            WhisperFeatureExtractor::from_json(&serde_json::json!({"feature_size": 80, "chunk_length": 2})).unwrap();
        let mut padded = fe.clone();
        padded.padding_value = 0.01;
        let tone = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    (0.3 * (i as f32 * 0.07).sin() + 0.1 * (i as f32 * 1.3).cos()) * (1.0 + (i % 97) as f32 / 97.0)
                })
                .collect()
        };
        let mut late = vec![0f32; 9000];
        late.extend(tone(4000));
        for (fe, samples) in
            [(&fe, tone(40_000)), (&fe, tone(32_000)), (&fe, tone(5_123)), (&fe, late), (&padded, tone(7_000))]
        {
            let got = fe.extract(&samples).input_features;
            let want = per_frame_reference(fe, &samples);
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 2e-5, "{} samples: {err}", samples.len());
        }
    }

    #[test]
    fn qwen2_audio_token_formula() {
        let expected =
            [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 1), (7, 2), (137, 34), (2999, 750), (3000, 750)];
        for (frames, tokens) in expected {
            assert_eq!(qwen2_audio_tokens(frames), tokens, "{frames}");
        }
        // A stride-2 convolution (kernel 3, padding 1: ceil(L/2) outputs), then a stride-2 pool.
        for frames in 0..5000 {
            assert_eq!(qwen2_audio_tokens(frames), frames.div_ceil(2) / 2, "{frames}");
        }
    }
}
