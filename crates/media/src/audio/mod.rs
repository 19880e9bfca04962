//! Audio front end: bytes → 16 kHz mono → Whisper log-mel features, matching transformers'
//! Qwen2-Audio processor (soundfile backend).
//!
//! - [`decode_audio`]: WAV, MP3, FLAC, Ogg Vorbis, M4A/AAC (symphonia) → mono `f32` by channel
//!   averaging → 16 kHz (rubato); the length limit of [`AudioLimits`] is checked on the header
//!   before decoding where the container states a length, and on the source's samples before any
//!   resampling; rates outside `min_sample_rate..=max_sample_rate` are refused; `keep_samples`
//!   bounds what is held and resampled to the window the model hears. [`probe_duration`] reads the
//!   header only.
//! - [`WhisperFeatureExtractor`]: `preprocessor_config.json` → `[n_mels, 3000]` log-mel features and
//!   the frame mask; clips over 30 s are truncated, as transformers does.
//! - [`qwen2_audio_tokens`]: the number of `<|AUDIO|>` placeholders for the valid frames.
//!
//! Every [`AudioError`] message is meant for the client (an HTTP 400).

mod decode;
mod error;
mod stft;
mod whisper;

pub use decode::{AudioLimits, TARGET_SAMPLE_RATE, Waveform, decode_audio, probe_duration};
pub use error::AudioError;
pub use whisper::{Features, MelFilter, WhisperFeatureExtractor, mel_filter_bank, qwen2_audio_tokens};
