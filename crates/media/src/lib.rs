//! Media front end of mmserve: image decoding and CLIP-style preprocessing that
//! reproduce transformers' PIL-backend processors value for value.
//!
//! - [`decode_image`]: bytes → RGB8 like `PIL.Image.open(..).convert("RGB")`, with a
//!   pixel limit checked on the header before decoding.
//! - [`resize_bicubic`]: PIL's fixed-point bicubic resize, bit-exact, and
//!   [`resize_bicubic_window`] for a crop of it.
//! - [`ClipImageProcessor`]: `preprocessor_config.json` → CHW `f32` pixel values.
//! - [`image_header`]: format and size (after EXIF orientation) from the header alone.
//! - [`Qwen2VlImageProcessor`]: Qwen2-VL / Qwen2.5-VL `smart_resize`, patches and token counts.
//! - [`ImageProcessor`]: whichever of the two a `preprocessor_config.json` names.

pub mod audio;
pub mod clip;
pub mod decode;
pub mod error;
pub mod header;
mod jpeg;
pub mod mrope;
mod orient;
pub mod processor;
pub mod qwen2vl;
pub mod resample;
mod simd;

pub use clip::{ClipImageProcessor, Resize};
pub use decode::{ImageLimits, decode_image, image_dimensions};
pub use error::MediaError;
pub use header::{ImageFormat, ImageHeader, image_header};
pub use image::RgbImage;
pub use processor::{ImagePixels, ImageProcessor};
pub use qwen2vl::{Qwen2VlImageProcessor, Qwen2VlPixels, smart_resize};
pub use resample::{resize_bicubic, resize_bicubic_window};
