//! Image decoding to RGB8, matching what transformers feeds its processors
//! (`PIL.Image.open` → `ImageOps.exif_transpose` → `convert("RGB")`).
//!
//! The pixel count is read from the header and checked against
//! [`ImageLimits`] before any pixel data is decoded.
//!
//! Covered here, and matching PIL:
//! - 8-bit RGB, RGBA, grey and grey+alpha in PNG, BMP, GIF (first frame), JPEG and WebP:
//!   alpha is dropped (the stored colour is kept, not composited); grey is replicated to R, G and B.
//! - 16-bit PNG: grey is clamped to 255 (PIL's `I;16` → `RGB`), RGB(A) and grey+alpha keep the high byte.
//! - EXIF orientation, where the decoder exposes it.
//!
//! Not reproduced exactly yet: palette images with a transparent colour key (PIL turns
//! the key colour white), CMYK JPEG (the decoder's own CMYK → RGB is used), and the one
//! or two levels by which JPEG and lossy WebP decoders differ between libraries.

use std::io::Cursor;

use image::{DynamicImage, ImageDecoder, ImageError, ImageReader, Rgb, RgbImage};

use crate::MediaError;

/// Limits checked against the image header before decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// Largest accepted `width × height`.
    pub max_pixels: u64,
}

impl Default for ImageLimits {
    /// PIL's decompression-bomb error threshold (2 × 89,478,485 pixels).
    fn default() -> Self {
        Self { max_pixels: 178_956_970 }
    }
}

fn reader(bytes: &[u8]) -> Result<ImageReader<Cursor<&[u8]>>, MediaError> {
    if bytes.is_empty() {
        return Err(MediaError::Undecodable("no image data".into()));
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| MediaError::Undecodable(e.to_string()))?;
    match reader.format() {
        None => Err(MediaError::Undecodable("unrecognised image format".into())),
        Some(f) if !f.reading_enabled() => Err(MediaError::UnsupportedFormat(f.to_mime_type().into())),
        Some(_) => Ok(reader),
    }
}

fn map_err(e: ImageError) -> MediaError {
    match e {
        ImageError::Unsupported(e) => MediaError::UnsupportedFormat(e.to_string()),
        e => MediaError::Undecodable(e.to_string()),
    }
}

fn check(width: u32, height: u32, limits: &ImageLimits) -> Result<(), MediaError> {
    if width == 0 || height == 0 {
        return Err(MediaError::ZeroSized);
    }
    if u64::from(width) * u64::from(height) > limits.max_pixels {
        return Err(MediaError::TooLarge { width, height, max_pixels: limits.max_pixels });
    }
    Ok(())
}

/// Width and height from the header alone (no pixel data is decoded).
pub fn image_dimensions(bytes: &[u8]) -> Result<(u32, u32), MediaError> {
    let mut reader = reader(bytes)?;
    // Decoders may refuse a large image while reading its header; we want the size.
    reader.no_limits();
    reader.into_dimensions().map_err(map_err)
}

/// Decodes an image and converts it to RGB8 the way PIL's `convert("RGB")` does
/// (see the module doc for what is covered), after applying EXIF orientation.
/// The size is checked against `limits` before any pixel data is decoded.
pub fn decode_image(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, MediaError> {
    let (width, height) = image_dimensions(bytes)?;
    check(width, height, limits)?;
    let mut reader = reader(bytes)?;
    let mut decoder_limits = image::Limits::default();
    // Room for the largest accepted image at 8 bytes per pixel (RGBA16).
    decoder_limits.max_alloc = Some(limits.max_pixels.saturating_mul(8).max(512 << 20));
    reader.limits(decoder_limits);
    let mut decoder = reader.into_decoder().map_err(map_err)?;
    let orientation = decoder.orientation().map_err(map_err)?;
    let mut img = DynamicImage::from_decoder(decoder).map_err(map_err)?;
    img.apply_orientation(orientation);
    Ok(to_rgb8(img))
}

/// PIL's `convert("RGB")` for the pixel layouts the decoders produce.
fn to_rgb8(img: DynamicImage) -> RgbImage {
    fn map16<const N: usize>(w: u32, h: u32, raw: &[u16], f: impl Fn(&[u16]) -> [u8; 3]) -> RgbImage {
        RgbImage::from_fn(w, h, |x, y| {
            let i = (y as usize * w as usize + x as usize) * N;
            Rgb(f(&raw[i..i + N]))
        })
    }
    let (w, h) = (img.width(), img.height());
    match img {
        DynamicImage::ImageRgb8(img) => img,
        DynamicImage::ImageLuma16(b) => map16::<1>(w, h, b.as_raw(), |p| [p[0].min(255) as u8; 3]),
        DynamicImage::ImageLumaA16(b) => map16::<2>(w, h, b.as_raw(), |p| [(p[0] >> 8) as u8; 3]),
        DynamicImage::ImageRgb16(b) => map16::<3>(w, h, b.as_raw(), |p| [p[0], p[1], p[2]].map(|v| (v >> 8) as u8)),
        DynamicImage::ImageRgba16(b) => map16::<4>(w, h, b.as_raw(), |p| [p[0], p[1], p[2]].map(|v| (v >> 8) as u8)),
        // 8-bit grey, grey+alpha and RGBA: the image crate replicates grey and drops alpha.
        img => img.into_rgb8(),
    }
}
