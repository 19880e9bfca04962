//! Why audio was refused. Every message is meant to be shown to the client as-is (it becomes the
//! text of an HTTP 400 answer).

/// The largest sample magnitude accepted (float formats may store any value; ±1 is full scale).
pub const MAX_SAMPLE: f32 = 65536.0;

/// Why an audio clip was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AudioError {
    /// The bytes are not audio we can read, or they are corrupt or truncated.
    #[error("the audio could not be decoded: {0}")]
    Undecodable(String),
    /// A container (file format) this server does not read.
    #[error("unsupported audio container: {0}")]
    UnsupportedContainer(String),
    /// A known container holding a codec this server does not decode.
    #[error("unsupported audio codec: {0}")]
    UnsupportedCodec(String),
    /// A sample rate outside what this server accepts.
    #[error("unsupported audio sample rate: {rate} Hz (the limit is {max_rate} Hz)")]
    UnsupportedSampleRate { rate: u32, max_rate: u32 },
    /// A sample rate below what this server accepts (0 Hz included): resampling it to 16 kHz
    /// would multiply the samples.
    #[error("unsupported audio sample rate: {rate} Hz (the minimum is {min_rate} Hz)")]
    SampleRateTooLow { rate: u32, min_rate: u32 },
    /// No bytes at all, or a stream without a single sample.
    #[error("the audio is empty")]
    Empty,
    /// Float samples that are NaN, infinite or absurdly large: no recording holds them, and
    /// they would poison the resampler and the features.
    #[error(
        "the audio holds samples that are not finite numbers of sane size (NaN, infinity, or beyond ±{MAX_SAMPLE})"
    )]
    BadSamples,
    /// Longer than allowed: known from the container's header (nothing was decoded), or counted
    /// while decoding (decoding stopped as soon as the limit was passed).
    #[error("the audio is too long: {} exceeds the limit of {max_seconds} s", describe_length(*.seconds))]
    TooLong {
        /// The duration the header states, or `None` when the limit was passed while decoding.
        seconds: Option<f64>,
        max_seconds: f64,
    },
    /// So short that the model gets no audio token from it.
    #[error(
        "the audio is too short ({seconds:.3} s): it yields no audio token; at least {min_seconds:.3} s are needed"
    )]
    TooShort { seconds: f64, min_seconds: f64 },
    /// `preprocessor_config.json` holds something this crate does not implement or that is invalid.
    #[error("bad audio preprocessor config: {0}")]
    BadConfig(String),
}

fn describe_length(seconds: Option<f64>) -> String {
    match seconds {
        Some(s) => format!("its duration of {s:.1} s"),
        None => "its duration".to_owned(),
    }
}
