//! Media items of a request: fetched ([`crate::fetch`]), checked and keyed for the embed
//! cache — the CPU work off the event loop, on a bounded number of blocking threads.
//!
//! Before any byte is fetched, a `data:` URL's declared media type must match the part
//! (`image/*` for `image_url`, `audio/*` for `audio_url`; one that declares no type is
//! judged by its content), and `input_audio.format` must name a container we decode.
//!
//! Images are checked from the header only (format, pixel limit); full decoding and
//! preprocessing happen in the encoder, for cache misses only. Audio is decoded here
//! (16 kHz mono, truncated to the extractor's 30 s window), because its token count
//! depends on the exact number of samples; the encoder receives those samples and
//! computes the log-mel features (see ARCHITECTURE.md). Only that window is decoded and
//! resampled: the clip's length and sample rate are checked from its header first, and
//! decoding stops after the window when the header states the length (a clip that states
//! none is decoded on, unkept, to enforce `--max-audio-seconds`). A request's audio work is
//! thus bounded by its item count times the window, or times the limit for clips that state
//! no length.

use std::sync::Arc;

use mmserve_media::audio::{AudioLimits, WhisperFeatureExtractor, decode_audio};
use mmserve_media::{ImageLimits, ImageProcessor, image_header};
use mmserve_protocol::{ItemDigest, Modality};

use crate::cpu;
use crate::error::ApiError;
use crate::fetch::{FetchPolicy, base64_payload, data_url_type, fetch};
use crate::openai::AudioSource;
use crate::prompt::ItemSource;

/// An item ready for the cache: the bytes the encoder reads, and its key.
pub struct MediaItem {
    /// Images: the file as sent. Audio: 16 kHz mono `f32` samples, little-endian.
    pub bytes: Vec<u8>,
    pub digest: ItemDigest,
    pub modality: Modality,
    pub token_num: u32,
    /// Qwen-VL images: the merged patch grid (rows, columns) the tokens lay out.
    pub grid: Option<(usize, usize)>,
    /// Qwen-VL images: the pixel bounds they are resized within (the config's, or those
    /// the request chose in `mm_processor_kwargs`), which the encoder resizes within too.
    pub pixel_bounds: Option<(u64, u64)>,
}

/// What the served model takes, with what prepares it.
#[derive(Debug, Clone)]
pub enum ModelMedia {
    /// `model_tokens`: the token count when the model fixes it (LLaVA); otherwise the
    /// processor computes it from the header (Qwen2-VL).
    Image {
        processor: ImageProcessor,
        model_tokens: u32,
    },
    Audio(WhisperFeatureExtractor),
}

impl ModelMedia {
    pub fn modality(&self) -> Modality {
        match self {
            ModelMedia::Image { .. } => Modality::Image,
            ModelMedia::Audio(_) => Modality::Audio,
        }
    }

    /// The processor's `(min_pixels, max_pixels)`, where it has them (Qwen-VL).
    pub fn pixel_bounds(&self) -> Option<(u64, u64)> {
        match self {
            ModelMedia::Image { processor, .. } => processor.pixel_bounds(),
            ModelMedia::Audio(_) => None,
        }
    }

    /// Everything besides the bytes that changes an item's embedding (the model name is
    /// added by the caller).
    pub fn fingerprint(&self) -> String {
        match self {
            ModelMedia::Image { processor, .. } => processor.fingerprint(),
            ModelMedia::Audio(fe) => fe.fingerprint(),
        }
    }
}

/// Limits checked before any expensive work.
#[derive(Debug, Clone)]
pub struct MediaLimits {
    pub max_items: usize,
    pub image: ImageLimits,
    pub audio: AudioLimits,
    pub fetch: FetchPolicy,
    /// The api's CPU pool ([`cpu`]): media checks, hashing, audio decoding, tokenizing.
    pub cpu: crate::cpu::Pool,
    /// The largest pixel bound `mm_processor_kwargs` may set (0: the model has none).
    pub kwargs_max_pixels: u64,
    pub model: ModelMedia,
}

/// The media settings of one request: the server's, or those its `mm_processor_kwargs`
/// chose (Qwen-VL: `min_pixels`, `max_pixels`, each within `--mm-max-pixels`).
pub struct RequestMedia {
    pub limits: MediaLimits,
    /// The items' digest key: the model name and the processor's settings.
    pub fingerprint: String,
}

impl RequestMedia {
    /// `None` when the request changes nothing (no kwargs, or an empty object).
    pub fn from_kwargs(
        kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
        limits: &MediaLimits,
        model_name: &str,
    ) -> Result<Option<Self>, ApiError> {
        let Some(kwargs) = kwargs.filter(|k| !k.is_empty()) else { return Ok(None) };
        let ModelMedia::Image { processor, model_tokens } = &limits.model else {
            return Err(ApiError::bad_param(
                "mm_processor_kwargs",
                format!("model {model_name}'s audio feature extractor takes no mm_processor_kwargs"),
            ));
        };
        let Some((mut min, mut max)) = processor.pixel_bounds() else {
            return Err(ApiError::bad_param(
                "mm_processor_kwargs",
                format!(
                    "model {model_name}'s image processor resizes to a fixed size and takes no mm_processor_kwargs"
                ),
            ));
        };
        for (key, value) in kwargs {
            let field = format!("mm_processor_kwargs.{key}");
            let bound = match key.as_str() {
                "min_pixels" => &mut min,
                "max_pixels" => &mut max,
                _ => {
                    return Err(ApiError::bad_param(
                        &field,
                        format!(
                            "{field} is not supported: model {model_name}'s processor takes min_pixels and max_pixels"
                        ),
                    ));
                }
            };
            *bound = value
                .as_u64()
                .filter(|&n| n > 0)
                .ok_or_else(|| ApiError::bad_param(&field, format!("{field} must be a positive integer")))?;
            if *bound > limits.kwargs_max_pixels {
                return Err(ApiError::bad_param(
                    &field,
                    format!(
                        "{field} is {}; this server allows at most {} (--mm-max-pixels)",
                        *bound, limits.kwargs_max_pixels
                    ),
                ));
            }
        }
        let processor = processor
            .with_pixel_bounds(min, max)
            .map_err(|e| ApiError::bad_param("mm_processor_kwargs", format!("mm_processor_kwargs: {e}")))?;
        let model = ModelMedia::Image { processor, model_tokens: *model_tokens };
        let fingerprint = format!("{model_name};{}", model.fingerprint());
        Ok(Some(RequestMedia { limits: MediaLimits { model, ..limits.clone() }, fingerprint }))
    }
}

/// The name a client used for an item's part, for error messages.
fn param(src: &ItemSource) -> &'static str {
    match src {
        ItemSource::Image(_) => "image_url",
        ItemSource::Audio(AudioSource::Inline { .. }) => "input_audio",
        ItemSource::Audio(AudioSource::Url(_)) => "audio_url",
    }
}

/// The `input_audio.format` values we take: the containers [`decode_audio`] reads.
const AUDIO_FORMATS: [&str; 7] = ["wav", "mp3", "flac", "ogg", "m4a", "mp4", "aac"];

/// Refuses an `input_audio.format` we do not decode; the format, normalised, is the
/// decoder's hint (the content decides, the hint breaks ties). None when absent.
fn check_format(format: Option<&str>) -> Result<Option<String>, ApiError> {
    let Some(format) = format else { return Ok(None) };
    let f = format.trim().to_ascii_lowercase();
    if AUDIO_FORMATS.contains(&f.as_str()) {
        return Ok(Some(f));
    }
    Err(ApiError::bad_param(
        "input_audio.format",
        format!("unsupported input_audio `format` {format:?}: use one of {}", AUDIO_FORMATS.join(", ")),
    ))
}

/// Refuses a `data:` URL that declares a media type other than `kind/*` (OpenAI's "Invalid
/// MIME type"); returns the declared type (a hint for the audio decoder).
fn check_declared_type(url: &str, kind: &str, param: &str) -> Result<Option<String>, ApiError> {
    let Some(mime) = data_url_type(url) else { return Ok(None) };
    match mime.split_once('/') {
        Some((top, sub)) if top == kind && !sub.is_empty() => Ok(Some(mime)),
        _ => Err(ApiError::bad_param(
            param,
            format!("invalid MIME type {mime:?} in the data: URL: {param} takes {kind}/* (or no declared type)"),
        )),
    }
}

/// Refuses an item the model cannot take, naming what it takes.
pub fn check_kind(src: &ItemSource, model: &ModelMedia, model_name: &str) -> Result<(), ApiError> {
    let (sent, takes) = match (src, model) {
        (ItemSource::Image(_), ModelMedia::Image { .. }) | (ItemSource::Audio(_), ModelMedia::Audio(_)) => {
            return Ok(());
        }
        (ItemSource::Image(_), ModelMedia::Audio(_)) => ("images", "audio"),
        (ItemSource::Audio(_), ModelMedia::Image { .. }) => ("audio", "images"),
    };
    Err(ApiError::bad_param(param(src), format!("model {model_name} accepts text and {takes}, not {sent}")))
}

/// The prompt tokens a request's media may still take: each item takes at least what its
/// header promises before it is decoded, so a request whose text and media cannot fit the
/// context is refused before its audio is decoded. (The exact count is checked once every
/// item is ready.)
pub struct TokenBudget {
    left: std::sync::atomic::AtomicU64,
    context: u64,
}

impl TokenBudget {
    /// What `context` leaves after `text_tokens`.
    pub fn new(context: u64, text_tokens: u64) -> Arc<Self> {
        Arc::new(TokenBudget { left: context.saturating_sub(text_tokens).into(), context })
    }

    fn take(&self, n: u64, param: &str) -> Result<(), ApiError> {
        use std::sync::atomic::Ordering;
        self.left.fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| left.checked_sub(n)).map(drop).map_err(
            |_| {
                ApiError::bad_param(
                    param,
                    format!(
                        "the prompt's text and media take more than this model's context of {} tokens",
                        self.context
                    ),
                )
            },
        )
    }
}

/// Fetches, checks and keys one item, taking its tokens from `budget`.
pub async fn prepare(
    src: &ItemSource,
    limits: &MediaLimits,
    fingerprint: &str,
    budget: &Arc<TokenBudget>,
) -> Result<MediaItem, ApiError> {
    let p = param(src);
    let (bytes, hint) = match src {
        ItemSource::Image(url) => {
            check_declared_type(url, "image", p)?;
            (fetch(url, &limits.fetch, p).await?, None)
        }
        ItemSource::Audio(AudioSource::Url(url)) => {
            let mime = check_declared_type(url, "audio", p)?;
            (fetch(url, &limits.fetch, p).await?, mime)
        }
        ItemSource::Audio(AudioSource::Inline { data, format }) => {
            let format = check_format(format.as_deref())?;
            (base64_payload(data, limits.fetch.max_bytes, p)?, format)
        }
    };
    let (limits, fingerprint, budget) = (limits.clone(), fingerprint.to_string(), budget.clone());
    cpu::run(&limits.cpu.clone(), "checking media", move || match &limits.model {
        ModelMedia::Image { processor, model_tokens } => {
            budget.take(u64::from(*model_tokens), p)?;
            check_image(bytes, &limits.image, processor, *model_tokens, &fingerprint)
        }
        ModelMedia::Audio(fe) => audio(bytes, hint.as_deref(), &limits.audio, fe, &fingerprint, p, &budget),
    })
    .await?
}

fn check_image(
    bytes: Vec<u8>,
    limits: &ImageLimits,
    processor: &ImageProcessor,
    model_tokens: u32,
    fingerprint: &str,
) -> Result<MediaItem, ApiError> {
    let bad = |e: mmserve_media::MediaError| ApiError::bad_param("image_url", e.to_string());
    let header = image_header(&bytes).map_err(bad)?;
    let (w, h) = (header.width, header.height);
    if u64::from(w) * u64::from(h) > limits.max_pixels {
        return Err(ApiError::bad_param(
            "image_url",
            format!("the image is {w}×{h}, more than the limit of {} pixels (--max-image-pixels)", limits.max_pixels),
        ));
    }
    if w == 0 || h == 0 {
        return Err(ApiError::bad_param("image_url", "the image has no pixels"));
    }
    let token_num = match processor.num_tokens(w, h).map_err(bad)? {
        Some(n) => u32::try_from(n).map_err(|_| ApiError::bad_param("image_url", "the image is too large"))?,
        None => model_tokens,
    };
    let grid = processor.merged_grid(w, h).map_err(bad)?;
    let digest = ItemDigest::compute(Modality::Image, fingerprint, &bytes);
    let pixel_bounds = processor.pixel_bounds();
    Ok(MediaItem { bytes, digest, modality: Modality::Image, token_num, grid, pixel_bounds })
}

fn audio(
    bytes: Vec<u8>,
    hint: Option<&str>,
    limits: &AudioLimits,
    fe: &WhisperFeatureExtractor,
    fingerprint: &str,
    param: &str,
    budget: &TokenBudget,
) -> Result<MediaItem, ApiError> {
    use mmserve_media::audio::AudioError;
    let bad = |e: AudioError| match e {
        AudioError::TooLong { .. } => ApiError::bad_param(param, format!("{e} (--max-audio-seconds)")),
        e => ApiError::bad_param(param, e.to_string()),
    };
    // Tokens from the length the header states, before decoding: a lower bound (a stated
    // length may exceed what decodes by the codec's padding, hence the 5% off).
    if let Ok(Some(seconds)) = mmserve_media::audio::probe_duration(&bytes, hint) {
        let samples = (seconds.min(fe.n_samples as f64 / f64::from(fe.sampling_rate))
            * 0.95
            * f64::from(fe.sampling_rate)) as usize;
        budget.take(fe.qwen2_audio_tokens_for(samples).unwrap_or(0) as u64, param)?;
    }
    // The model hears the first 30 s (transformers truncates likewise): nothing past them
    // is resampled or kept, nor decoded when the header states the length.
    let limits = AudioLimits { keep_samples: Some(fe.n_samples), ..limits.clone() };
    let wave = decode_audio(&bytes, hint, &limits).map_err(bad)?;
    let used = &wave.samples[..wave.samples.len().min(fe.n_samples)];
    let token_num = fe.qwen2_audio_tokens_for(used.len()).map_err(bad)?;
    let digest = ItemDigest::compute(Modality::Audio, fingerprint, &bytes);
    let pcm: Vec<u8> = used.iter().flat_map(|s| s.to_le_bytes()).collect();
    Ok(MediaItem {
        bytes: pcm,
        digest,
        modality: Modality::Audio,
        token_num: token_num as u32,
        grid: None,
        pixel_bounds: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(r: Result<Option<String>, ApiError>) -> (String, Option<String>) {
        match r {
            Err(ApiError::BadRequest { message, param }) => (message, param),
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn a_data_url_must_declare_the_parts_kind() {
        assert_eq!(
            check_declared_type("data:image/png;base64,AA==", "image", "image_url").unwrap().unwrap(),
            "image/png"
        );
        assert_eq!(
            check_declared_type("data:Audio/X-WAV;base64,AA==", "audio", "audio_url").unwrap().unwrap(),
            "audio/x-wav"
        );
        // No declared type, or not a data: URL: judged by the content.
        for url in ["data:;base64,AA==", "https://example.com/a.wav", "file:///m/a.png"] {
            assert_eq!(check_declared_type(url, "image", "image_url").unwrap(), None, "{url}");
        }
        for (url, kind, param) in [
            ("data:audio/wav;base64,AA==", "image", "image_url"),
            ("data:application/octet-stream;base64,AA==", "image", "image_url"),
            ("data:text/plain;base64,AA==", "image", "image_url"),
            ("data:image/;base64,AA==", "image", "image_url"),
            ("data:image/png;base64,AA==", "audio", "audio_url"),
            ("data:video/mp4;base64,AA==", "audio", "audio_url"),
        ] {
            let (msg, p) = refusal(check_declared_type(url, kind, param));
            assert!(msg.starts_with("invalid MIME type") && msg.contains(&format!("{kind}/*")), "{url}: {msg}");
            assert_eq!(p.as_deref(), Some(param));
        }
    }

    #[test]
    fn input_audio_format_must_be_one_we_decode() {
        assert_eq!(check_format(None).unwrap(), None);
        for f in AUDIO_FORMATS {
            assert_eq!(check_format(Some(f)).unwrap().as_deref(), Some(f));
        }
        assert_eq!(check_format(Some(" WAV ")).unwrap().as_deref(), Some("wav"));
        for f in ["xyz", "", "pcm16", "opus", "audio/wav", ".wav"] {
            let (msg, p) = refusal(check_format(Some(f)));
            assert_eq!(p.as_deref(), Some("input_audio.format"));
            assert!(msg.contains("`format`") && msg.contains("wav, mp3, flac, ogg, m4a, mp4, aac"), "{f}: {msg}");
        }
    }
}
