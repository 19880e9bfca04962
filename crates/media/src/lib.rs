//! Media front end of mmserve: image decoding and CLIP-style preprocessing that
//! reproduce transformers' PIL-backend processors value for value.
//!
//! - [`decode_image`]: bytes → RGB8 like `PIL.Image.open(..).convert("RGB")`, with a
//!   pixel limit checked on the header before decoding.
//! - [`resize_bicubic`]: PIL's fixed-point bicubic resize, bit-exact, and
//!   [`resize_bicubic_window`] for a crop of it.
//! - [`ClipImageProcessor`]: `preprocessor_config.json` → CHW `f32` pixel values.

pub mod audio;
pub mod clip;
pub mod decode;
pub mod error;
pub mod qwen2vl;
pub mod resample;

pub use clip::{ClipImageProcessor, Resize};
pub use decode::{ImageLimits, decode_image, image_dimensions};
pub use error::MediaError;
pub use image::RgbImage;
pub use resample::{resize_bicubic, resize_bicubic_window};
