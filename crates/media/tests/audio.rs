//! The audio front end against transformers 5.24's Qwen2-Audio processor (fixture `qwen2_audio`)
//! and against files in other formats made from the same clip by `data/audio/make.py`.

#[path = "support/wav.rs"]
mod wav;

use std::path::Path;
use std::sync::LazyLock;

use mmserve_media::audio::{
    AudioError, AudioLimits, Features, Waveform, WhisperFeatureExtractor, decode_audio, probe_duration,
    qwen2_audio_tokens,
};
use safetensors::{Dtype, SafeTensors};
use wav::wav16;

fn read(name: &str) -> Vec<u8> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/audio").join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

struct Reference {
    waveform: Vec<f32>,
    /// `[128, 160]`: frames 160.. all equal `features_pad`.
    features_head: Vec<f32>,
    features_pad: Vec<f32>,
    mask: Vec<i64>,
    soxr_44k1: Vec<f32>,
    soundfile_mp3: Vec<f32>,
    soundfile_ogg: Vec<f32>,
}

static REF: LazyLock<Reference> = LazyLock::new(|| {
    let bytes = read("reference.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str, shape: &[usize]| -> Vec<f32> {
        let t = st.tensor(name).unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::F32, shape), "{name}");
        t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    };
    let mask = st.tensor("feature_attention_mask").unwrap();
    assert_eq!((mask.dtype(), mask.shape()), (Dtype::I64, &[3000][..]));
    let mp3_len = st.tensor("soundfile_mp3").unwrap().shape()[0];
    Reference {
        waveform: f32s("waveform", &[21920]),
        features_head: f32s("input_features_head", &[128, 160]),
        features_pad: f32s("input_features_pad", &[128]),
        mask: mask.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect(),
        soxr_44k1: f32s("soxr_44k1", &[21920]),
        soundfile_mp3: f32s("soundfile_mp3", &[mp3_len]),
        soundfile_ogg: f32s("soundfile_ogg", &[21920]),
    }
});

static FE: LazyLock<WhisperFeatureExtractor> = LazyLock::new(|| {
    let config: serde_json::Value = serde_json::from_slice(&read("preprocessor_config.json")).unwrap();
    WhisperFeatureExtractor::from_json(&config).unwrap()
});

fn decode(name: &str) -> Waveform {
    let hint = name.rsplit('.').next();
    decode_audio(&read(name), hint, &AudioLimits::default()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The fixture's features, expanded to `[128, 3000]`.
fn reference_features() -> Vec<f32> {
    let r = &*REF;
    (0..128)
        .flat_map(|m| (0..3000).map(move |t| if t < 160 { r.features_head[m * 160 + t] } else { r.features_pad[m] }))
        .collect()
}

/// Max abs difference of `f`'s features from the fixture's over the frames that hold audio.
fn feature_error(f: &Features) -> f32 {
    let reference = reference_features();
    (0..128)
        .flat_map(|m| (0..137).map(move |t| m * 3000 + t))
        .map(|i| (f.input_features[i] - reference[i]).abs())
        .fold(0.0, f32::max)
}

#[test]
fn fixture_decodes_to_the_reference_waveform() {
    let w = decode("input.wav");
    assert_eq!((w.sample_rate, w.source_rate, w.channels), (16000, 16000, 1));
    assert_eq!(w.samples.len(), 21920);
    assert_eq!(max_abs_diff(&w.samples, &REF.waveform), 0.0);
}

#[test]
fn fixture_features_match_transformers() {
    let f = FE.extract(&decode("input.wav").samples);
    assert_eq!((f.n_mels, f.n_frames, f.input_features.len()), (128, 3000, 128 * 3000));
    let err = max_abs_diff(&f.input_features, &reference_features());
    eprintln!("fixture features: max abs error {err:e}");
    assert!(err < 1e-4, "{err}");
    assert_eq!(f.attention_mask.iter().map(|&v| i64::from(v)).collect::<Vec<_>>(), REF.mask);
    assert_eq!(f.valid_frames, 137);
    assert_eq!(qwen2_audio_tokens(f.valid_frames), 34);
    assert_eq!(FE.qwen2_audio_tokens_checked(&f), Ok(34));
}

#[test]
fn header_states_the_duration() {
    assert_eq!(probe_duration(&read("input.wav"), Some("wav")), Ok(Some(1.37)));
    assert_eq!(probe_duration(&read("pcm16.flac"), Some("audio/flac")), Ok(Some(1.37)));
}

/// Mean absolute difference of `f`'s features from the fixture's over the frames that hold audio.
fn feature_mean_error(f: &Features) -> f32 {
    let reference = reference_features();
    let sum: f32 = (0..128)
        .flat_map(|m| (0..137).map(move |t| m * 3000 + t))
        .map(|i| (f.input_features[i] - reference[i]).abs())
        .sum();
    sum / (128 * 137) as f32
}

#[test]
fn integer_pcm_is_scaled_like_libsndfile() {
    // make.py stored round(x · (2^(b−1) − 1)); libsndfile reads it back as that / 2^(b−1).
    for (name, bits, feature_tolerance) in
        [("pcm16.wav", 16, 0.02), ("pcm24.wav", 24, 1e-4), ("pcm32.wav", 32, 1e-4), ("u8.wav", 8, 1.0)]
    {
        let w = decode(name);
        assert_eq!((w.sample_rate, w.source_rate, w.channels), (16000, 16000, 1), "{name}");
        let full = f64::powi(2.0, bits - 1);
        let expected: Vec<f32> =
            REF.waveform.iter().map(|&x| ((f64::from(x) * (full - 1.0)).round() / full) as f32).collect();
        assert_eq!(max_abs_diff(&w.samples, &expected), 0.0, "{name}");
        let f = FE.extract(&w.samples);
        let (max, mean) = (feature_error(&f), feature_mean_error(&f));
        eprintln!("{name}: features vs fixture max {max:e} mean {mean:e}");
        assert!(max < feature_tolerance, "{name}: {max}");
        assert_eq!((f.valid_frames, qwen2_audio_tokens(f.valid_frames)), (137, 34), "{name}");
    }
}

#[test]
fn stereo_is_averaged() {
    // Left = pcm16.wav, right = the same reversed in time.
    let left = decode("pcm16.wav").samples;
    let w = decode("stereo_pcm16.wav");
    assert_eq!((w.source_rate, w.channels), (16000, 2));
    let expected: Vec<f32> = left.iter().zip(left.iter().rev()).map(|(l, r)| (l + r) / 2.0).collect();
    assert_eq!(max_abs_diff(&w.samples, &expected), 0.0);
}

#[test]
fn flac_equals_wav() {
    let w = decode("pcm16.flac");
    assert_eq!((w.source_rate, w.channels), (16000, 1));
    assert!(w.samples == decode("pcm16.wav").samples);
}

#[test]
fn resampling_from_44k1_is_close_to_soxr() {
    // transformers resamples with soxr "HQ"; make.py stored soxr's output for this very file.
    let w = decode("pcm16_44k1.wav");
    assert_eq!((w.sample_rate, w.source_rate, w.channels), (16000, 44100, 1));
    assert_eq!(w.samples.len(), 21920); // ceil(60417 · 16000 / 44100)
    let wave_err = max_abs_diff(&w.samples, &REF.soxr_44k1);
    let ours = FE.extract(&w.samples);
    let theirs = FE.extract(&REF.soxr_44k1);
    // Both filters pass up to ~7.3 kHz and differ in their transition bands above: compare the mel
    // bins below that tightly and the top three (centred at 7.4-7.8 kHz) loosely.
    let err = |mels: std::ops::Range<usize>| {
        mels.flat_map(|m| (0..3000).map(move |t| m * 3000 + t))
            .map(|i| (ours.input_features[i] - theirs.input_features[i]).abs())
            .fold(0.0, f32::max)
    };
    let (low, top) = (err(0..125), err(125..128));
    eprintln!("44.1 kHz: waveform vs soxr {wave_err:e}; features below 7.3 kHz {low:e}, top 3 mels {top:e}");
    assert!(wave_err < 3e-3, "{wave_err}");
    assert!(low < 0.01, "{low}");
    assert!(top < 0.5, "{top}");
    assert_eq!(ours.attention_mask, theirs.attention_mask);
}

#[test]
fn lossy_codecs_decode_like_soundfile() {
    // libsndfile (mpg123, libvorbis) is what transformers reads MP3 and Ogg with.
    for (name, reference) in [("chirp.mp3", &REF.soundfile_mp3), ("chirp.ogg", &REF.soundfile_ogg)] {
        let w = decode(name);
        assert_eq!((w.source_rate, w.channels), (16000, 1), "{name}");
        let err = max_abs_diff(&w.samples, reference);
        let f = FE.extract(&w.samples);
        let (max, mean) = (feature_error(&f), feature_mean_error(&f));
        eprintln!("{name}: waveform vs soundfile {err:e}; features vs the WAV's max {max:e} mean {mean:e}");
        assert!(err < 1e-5, "{name}: {err}");
        // Away from the chirp the clip is a low noise floor, which lossy coding reshapes: single
        // bins move by up to ~1, the mean stays small (measured: MP3 0.03, Vorbis 0.12).
        assert!(mean < 0.2, "{name}: {mean}");
        assert_eq!(qwen2_audio_tokens(f.valid_frames), 34, "{name}");
    }
}

#[test]
fn m4a_aac_is_decoded_and_its_priming_trimmed() {
    let w = decode("chirp.m4a");
    assert_eq!((w.source_rate, w.channels), (16000, 1));
    // The edit list says: skip 1024 priming frames, keep 1.370 s.
    assert_eq!(w.samples.len(), 21920);
    // Aligned with the source: the cross-correlation peaks at lag 0.
    let x = &REF.waveform;
    let corr = |lag: i64| -> f64 {
        (0..x.len() as i64)
            .filter_map(|i| {
                Some(
                    f64::from(x[usize::try_from(i + lag).ok().filter(|&j| j < x.len())?])
                        * f64::from(w.samples[i as usize]),
                )
            })
            .sum()
    };
    let best = (-1200..=1200).max_by(|&a, &b| corr(a).total_cmp(&corr(b))).unwrap();
    assert_eq!(best, 0);
    let f = FE.extract(&w.samples);
    let (max, mean) = (feature_error(&f), feature_mean_error(&f));
    eprintln!("chirp.m4a: features vs the WAV's max {max:e} mean {mean:e}");
    assert!(mean < 0.1, "{mean}");
}

#[test]
fn unsupported_codec_and_container_are_named() {
    let lim = AudioLimits::default();
    assert_eq!(decode_audio(&read("chirp.opus"), Some("opus"), &lim), Err(AudioError::UnsupportedCodec("Opus".into())));
    assert_eq!(
        decode_audio(&read("chirp.webm"), None, &lim),
        Err(AudioError::UnsupportedContainer("Matroska/WebM".into()))
    );
}

fn chirp16() -> Vec<i16> {
    REF.waveform.iter().map(|&x| (x * 32767.0).round() as i16).collect()
}

#[test]
fn length_limit_from_the_header_and_while_decoding() {
    let lim = AudioLimits::default();
    // A header that claims 3 hours: refused from the header, before decoding.
    let hours = wav16(&chirp16(), 16000, Some(16000 * 2 * 10800));
    assert_eq!(probe_duration(&hours, None), Ok(Some(10800.0)));
    assert_eq!(
        decode_audio(&hours, None, &lim),
        Err(AudioError::TooLong { seconds: Some(10800.0), max_seconds: 600.0 })
    );

    // A FLAC whose STREAMINFO leaves the total number of samples at 0 ("unknown", as written by a
    // streaming encoder) states no length: counted while decoding.
    let mut flac = read("pcm16.flac");
    assert_eq!(&flac[..4], b"fLaC");
    flac[21] &= 0xf0;
    flac[22..26].fill(0);
    assert_eq!(probe_duration(&flac, None), Ok(None));
    let short = AudioLimits { max_seconds: 1.0, ..AudioLimits::default() };
    assert_eq!(decode_audio(&flac, None, &short), Err(AudioError::TooLong { seconds: None, max_seconds: 1.0 }));
    assert!(decode_audio(&flac, None, &lim).unwrap().samples == decode("pcm16.wav").samples);

    // A streamed WAV (data length 0xFFFFFFFF) is read to its end.
    let streamed = wav16(&chirp16(), 16000, Some(u32::MAX));
    assert_eq!(probe_duration(&streamed, None), Ok(Some(1.37)));
    assert_eq!(decode_audio(&streamed, None, &lim).unwrap().samples.len(), 21920);

    // MP3 states its length in the Xing header.
    assert_eq!(
        decode_audio(&read("chirp.mp3"), None, &short),
        Err(AudioError::TooLong { seconds: Some(1.3709375), max_seconds: 1.0 })
    );
    let e = AudioError::TooLong { seconds: Some(10800.0), max_seconds: 600.0 };
    assert_eq!(e.to_string(), "the audio is too long: its duration of 10800.0 s exceeds the limit of 600 s");
}

#[test]
fn sample_rate_limit() {
    let lim = AudioLimits { max_sample_rate: 48_000, ..AudioLimits::default() };
    assert_eq!(
        decode_audio(&wav16(&chirp16(), 96_000, None), None, &lim),
        Err(AudioError::UnsupportedSampleRate { rate: 96_000, max_rate: 48_000 })
    );
}

#[test]
fn truncated_empty_and_garbage_are_refused() {
    let lim = AudioLimits::default();
    let undecodable = |r: Result<Waveform, AudioError>| matches!(r, Err(AudioError::Undecodable(_)));
    for name in ["pcm16.wav", "pcm16.flac", "chirp.ogg", "chirp.m4a", "input.wav"] {
        let b = read(name);
        for cut in [40, b.len() * 3 / 10, b.len() * 7 / 10, b.len() - 1] {
            let r = decode_audio(&b[..cut], None, &lim);
            assert!(undecodable(r.clone()), "{name} cut at {cut}: {r:?}");
        }
    }
    let r = decode_audio(&read("pcm16.wav")[..30_000], None, &lim);
    assert_eq!(r, Err(AudioError::Undecodable("the file is truncated".into())));
    // MP3 is a run of self-contained frames: a cut file decodes to what is there (as every player
    // and transformers do).
    let mp3 = read("chirp.mp3");
    assert!(decode_audio(&mp3[..mp3.len() / 2], None, &lim).unwrap().samples.len() < 12_000);

    assert_eq!(decode_audio(&[], None, &lim), Err(AudioError::Empty));
    assert_eq!(probe_duration(&[], None), Err(AudioError::Empty));
    assert_eq!(decode_audio(&wav16(&[], 16000, None), None, &lim), Err(AudioError::Empty));

    let mut x = 12345u64;
    let garbage: Vec<u8> = (0..65536)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect();
    let not_audio = AudioError::Undecodable("not a recognised audio format".into());
    assert_eq!(decode_audio(&garbage, Some("wav"), &lim), Err(not_audio.clone()));
    assert_eq!(decode_audio(&b"not audio at all\n".repeat(100), None, &lim), Err(not_audio.clone()));
    assert_eq!(probe_duration(&garbage, None), Err(not_audio));
}

#[test]
fn too_short_for_a_token() {
    // 3 feature frames give the first token: more than 2 hops (320 samples).
    let chirp = chirp16();
    let f =
        FE.extract(&decode_audio(&wav16(&chirp[..320], 16000, None), None, &AudioLimits::default()).unwrap().samples);
    assert_eq!(f.valid_frames, 2);
    assert_eq!(FE.qwen2_audio_tokens_checked(&f), Err(AudioError::TooShort { seconds: 0.02, min_seconds: 0.0200625 }));
    let f =
        FE.extract(&decode_audio(&wav16(&chirp[..321], 16000, None), None, &AudioLimits::default()).unwrap().samples);
    assert_eq!((f.valid_frames, FE.qwen2_audio_tokens_checked(&f)), (3, Ok(1)));
}

#[test]
fn clips_over_30_s_are_truncated() {
    let long: Vec<f32> = REF.waveform.iter().copied().cycle().take(35 * 16000).collect();
    let f = FE.extract(&long);
    assert_eq!((f.valid_frames, f.samples, qwen2_audio_tokens(f.valid_frames)), (3000, 480_000, 750));
    assert!(f.attention_mask.iter().all(|&m| m == 1));
    assert!(f.input_features == FE.extract(&long[..480_000]).input_features);
    assert!(f.input_features != FE.extract(&long[..479_000]).input_features);
}

#[test]
fn preprocessor_config_is_checked() {
    let base: serde_json::Value = serde_json::from_slice(&read("preprocessor_config.json")).unwrap();
    let with = |key: &str, v: serde_json::Value| {
        let mut c = base.clone();
        c[key] = v;
        WhisperFeatureExtractor::from_json(&c)
    };
    let fe80 = with("feature_size", 80.into()).unwrap();
    assert_eq!((fe80.mel_filters().len(), fe80.extract(&REF.waveform).input_features.len()), (80, 80 * 3000));
    for (key, v) in [
        ("sampling_rate", serde_json::json!(8000)),
        ("n_samples", serde_json::json!(160_000)),
        ("nb_max_frames", serde_json::json!(1500)),
        ("feature_extractor_type", serde_json::json!("SeamlessM4TFeatureExtractor")),
        ("dither", serde_json::json!(1e-5)),
        ("feature_size", serde_json::json!("128")),
        ("hop_length", serde_json::json!(0)),
    ] {
        assert!(matches!(with(key, v.clone()), Err(AudioError::BadConfig(_))), "{key}: {v}");
    }
    // Defaults: a bare config is Whisper's 80-mel one.
    let bare = WhisperFeatureExtractor::from_json(&serde_json::json!({})).unwrap();
    assert_eq!((bare.feature_size, bare.n_samples, bare.nb_max_frames, bare.n_fft), (80, 480_000, 3000, 400));
}
