//! Errors of the media front end. Every message is meant to be shown to the
//! client as-is (it becomes the text of an HTTP 400 answer).

/// Why an image was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MediaError {
    /// The bytes are not an image we can read, or they are corrupt.
    #[error("the image could not be decoded: {0}")]
    Undecodable(String),
    /// A known image format that this server does not decode.
    #[error("unsupported image format: {0}")]
    UnsupportedFormat(String),
    /// The header announces more pixels than allowed; nothing was decoded.
    #[error("the image is too large: {width}x{height} pixels exceeds the limit of {max_pixels} pixels")]
    TooLarge { width: u32, height: u32, max_pixels: u64 },
    /// The image has no pixels.
    #[error("the image has zero width or height")]
    ZeroSized,
    /// The image's shape cannot be preprocessed (the resize it implies is absurdly large).
    #[error(
        "the image's aspect ratio is too extreme: {width}x{height} pixels would have to be resized to {resized_width}x{resized_height}"
    )]
    ExtremeAspectRatio { width: u32, height: u32, resized_width: u64, resized_height: u64 },
    /// The image is too elongated for the processor (Qwen2-VL's `smart_resize`).
    #[error(
        "the image's aspect ratio is too extreme: {width}x{height} pixels (the longer side may be at most {max_ratio} times the shorter)"
    )]
    AspectRatio { width: u32, height: u32, max_ratio: u32 },
    /// `preprocessor_config.json` holds something this crate does not implement or that is invalid.
    #[error("bad image preprocessor config: {0}")]
    BadConfig(String),
}
