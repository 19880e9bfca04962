//! Image decoding to RGB8, matching what transformers' processors start from for an image
//! given as bytes: `PIL.Image.open` → `ImageOps.exif_transpose` → `convert("RGB")` in
//! `load_image`, then the processor's own `convert_to_rgb`.
//!
//! The header is read first ([`crate::header`]) and the pixel count checked against
//! [`ImageLimits`] before any pixel data is decoded.
//!
//! The RGB values equal Pillow 13's (libjpeg-turbo, libwebp, zlib) on every fixture:
//! - alpha is dropped, not composited (the stored colour under a transparent pixel is kept);
//!   grey is replicated to R, G and B;
//! - PNG at every bit depth: 16-bit grey is clamped to 255 (PIL's `I;16` → `RGB`), 16-bit
//!   colour and grey+alpha keep the high byte; 1/2/4-bit grey is scaled;
//! - PNG `tRNS` colour keys (palette, grey, RGB): every pixel of exactly the key colour turns
//!   white, with Pillow's quirks (see `header::png_key`);
//! - GIF: the first frame on its canvas, filled with the transparent index (or index 0),
//!   palette entries past the palette's end black, the transparent colour turned white;
//! - JPEG through [`crate::jpeg`], a port of libjpeg-turbo's arithmetic (baseline and
//!   progressive, any integral sampling, YCbCr / RGB / CMYK / YCCK, Pillow's inverted CMYK);
//!   what it does not cover (arithmetic coding, lossless, progressive files libjpeg would
//!   block-smooth, …) falls back on zune-jpeg, within a level or three;
//! - BMP, including Pillow's truncating expansion of 16-bit pixels; WebP (lossy: image-webp
//!   matches libwebp on the fixtures);
//! - EXIF orientation from JPEG, PNG (eXIf, text raw profile, XMP) and WebP (EXIF, XMP).

use std::io::Cursor;

use image::{DynamicImage, ImageError, ImageReader, Rgb, RgbImage};
use zune_core::{bytestream::ZCursor, colorspace::ColorSpace, options::DecoderOptions};

use crate::{
    MediaError,
    header::{ImageFormat, Probe, probe},
    jpeg, orient,
};

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

impl ImageLimits {
    /// Refuses an image with no pixels, or with more than the limit.
    pub fn check(&self, width: u32, height: u32) -> Result<(), MediaError> {
        if width == 0 || height == 0 {
            return Err(MediaError::ZeroSized);
        }
        if u64::from(width) * u64::from(height) > self.max_pixels {
            return Err(MediaError::TooLarge { width, height, max_pixels: self.max_pixels });
        }
        Ok(())
    }
}

fn bad(msg: impl Into<String>) -> MediaError {
    MediaError::Undecodable(msg.into())
}

fn map_err(e: ImageError) -> MediaError {
    match e {
        ImageError::Unsupported(e) => MediaError::UnsupportedFormat(e.to_string()),
        e => MediaError::Undecodable(e.to_string()),
    }
}

/// Width and height from the header alone (no pixel data is decoded), after EXIF
/// orientation (see [`crate::image_header`]).
pub fn image_dimensions(bytes: &[u8]) -> Result<(u32, u32), MediaError> {
    crate::image_header(bytes).map(|h| (h.width, h.height))
}

/// Decodes an image to the RGB8 array transformers' processors work on (see the module
/// doc). The size is checked against `limits` before any pixel data is decoded.
pub fn decode_image(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, MediaError> {
    let p = probe(bytes)?;
    limits.check(p.width, p.height)?;
    let img = match p.format {
        ImageFormat::Png => decode_png(bytes, &p, limits)?,
        ImageFormat::Jpeg => decode_jpeg(bytes, limits)?,
        ImageFormat::Gif => decode_gif(bytes, &p)?,
        ImageFormat::WebP => to_rgb8(decode_with_image(bytes, image::ImageFormat::WebP, limits)?, false),
        ImageFormat::Bmp => decode_bmp(bytes, limits)?,
    };
    if img.dimensions() != (p.width, p.height) {
        return Err(bad(format!(
            "the decoded image is {}x{} pixels, but its header says {}x{}",
            img.width(),
            img.height(),
            p.width,
            p.height
        )));
    }
    Ok(orient::apply(img, p.orientation))
}

fn decode_with_image(
    bytes: &[u8],
    format: image::ImageFormat,
    limits: &ImageLimits,
) -> Result<DynamicImage, MediaError> {
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    let mut decoder_limits = image::Limits::default();
    // Room for the largest accepted image at 8 bytes per pixel (RGBA16).
    decoder_limits.max_alloc = Some(limits.max_pixels.saturating_mul(8).max(512 << 20));
    reader.limits(decoder_limits);
    reader.decode().map_err(map_err)
}

fn decode_png(bytes: &[u8], p: &Probe, limits: &ImageLimits) -> Result<RgbImage, MediaError> {
    let info = p.png.expect("PNG probe");
    let mut img = to_rgb8(decode_with_image(bytes, image::ImageFormat::Png, limits)?, info.color_type == 0);
    if let Some(key) = info.key {
        whiten(&mut img, key);
    }
    Ok(img)
}

/// Turns every pixel of exactly `key` white (transformers' composite over white of the
/// colour-key transparency that `convert("RGB")` leaves in the image's info).
fn whiten(img: &mut RgbImage, key: [u16; 3]) {
    for px in img.pixels_mut() {
        if px.0.map(u16::from) == key {
            px.0 = [255; 3];
        }
    }
}

/// PIL's `convert("RGB")` for the pixel layouts the `image` decoders produce.
/// `grey16_clamps`: 16-bit grey is PIL's `I;16`, clamped (a PNG colour key may have
/// given it an alpha channel on our side).
fn to_rgb8(img: DynamicImage, grey16_clamps: bool) -> RgbImage {
    fn map16<const N: usize>(w: u32, h: u32, raw: &[u16], f: impl Fn(&[u16]) -> [u8; 3]) -> RgbImage {
        RgbImage::from_fn(w, h, |x, y| {
            let i = (y as usize * w as usize + x as usize) * N;
            Rgb(f(&raw[i..i + N]))
        })
    }
    let (w, h) = (img.width(), img.height());
    let grey16 = |v: u16| if grey16_clamps { v.min(255) as u8 } else { (v >> 8) as u8 };
    match img {
        DynamicImage::ImageRgb8(img) => img,
        DynamicImage::ImageLuma16(b) => map16::<1>(w, h, b.as_raw(), |p| [p[0].min(255) as u8; 3]),
        DynamicImage::ImageLumaA16(b) => map16::<2>(w, h, b.as_raw(), |p| [grey16(p[0]); 3]),
        DynamicImage::ImageRgb16(b) => map16::<3>(w, h, b.as_raw(), |p| [p[0], p[1], p[2]].map(|v| (v >> 8) as u8)),
        DynamicImage::ImageRgba16(b) => map16::<4>(w, h, b.as_raw(), |p| [p[0], p[1], p[2]].map(|v| (v >> 8) as u8)),
        // 8-bit grey, grey+alpha and RGBA: the image crate replicates grey and drops alpha.
        img => img.into_rgb8(),
    }
}

/// JPEG through [`jpeg::decode`] (libjpeg-turbo's values), or, for what it does not
/// reproduce, zune-jpeg (within a level or two).
fn decode_jpeg(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, MediaError> {
    // Pillow refuses a JPEG whose data ends before its end-of-image marker.
    let scan = bytes.windows(2).position(|w| w == [0xff, 0xda]).unwrap_or(bytes.len());
    if !bytes[scan..].windows(2).any(|w| w == [0xff, 0xd9]) {
        return Err(bad("truncated JPEG (no end-of-image marker)"));
    }
    if let Some((w, h, rgb)) = jpeg::decode(bytes, limits.max_pixels) {
        return RgbImage::from_raw(w, h, rgb).ok_or_else(|| bad("JPEG decoder returned a short buffer"));
    }
    let jpeg_err = |e: zune_jpeg::errors::DecodeErrors| bad(format!("JPEG: {e:?}"));
    let options = DecoderOptions::default().set_strict_mode(false).set_max_width(1 << 16).set_max_height(1 << 16);
    let mut d = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    d.decode_headers().map_err(jpeg_err)?;
    let input = d.input_colorspace().unwrap_or(ColorSpace::Unknown);
    let output = match input {
        ColorSpace::Luma => ColorSpace::Luma,
        ColorSpace::YCbCr => ColorSpace::YCbCr,
        ColorSpace::RGB => ColorSpace::RGB,
        ColorSpace::CMYK | ColorSpace::YCCK => input,
        other => return Err(MediaError::UnsupportedFormat(format!("JPEG in colour space {other:?}"))),
    };
    d.set_options(d.options().jpeg_set_out_colorspace(output));
    let px = d.decode().map_err(jpeg_err)?;
    let (w, h) = d.dimensions().ok_or_else(|| bad("JPEG without dimensions"))?;
    let (w, h) = (w as u32, h as u32);
    let n = output.num_components();
    if px.len() != w as usize * h as usize * n {
        return Err(bad("JPEG decoder returned a short buffer"));
    }
    let rgb: Vec<u8> = match output {
        ColorSpace::RGB => px,
        ColorSpace::YCbCr => {
            px.chunks_exact(3).flat_map(|p| jpeg::ycc_to_rgb(p[0], p[1], p[2]).map(|v| v.clamp(0, 255) as u8)).collect()
        }
        ColorSpace::Luma => px.iter().flat_map(|&v| [v; 3]).collect(),
        ColorSpace::CMYK => px.chunks_exact(4).flat_map(|p| jpeg::pillow_cmyk([p[0], p[1], p[2], p[3]])).collect(),
        _ => px.chunks_exact(4).flat_map(|p| jpeg::pillow_cmyk(jpeg::ycck_to_cmyk([p[0], p[1], p[2], p[3]]))).collect(),
    };
    RgbImage::from_raw(w, h, rgb).ok_or_else(|| bad("JPEG decoder returned a short buffer"))
}

/// BMP through the `image` crate, except 16-bit pixels, which Pillow expands with
/// `v · 255 / 31` (or `/ 63`), truncating, and only in its two layouts (5-5-5 and 5-6-5).
fn decode_bmp(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, MediaError> {
    let le = |at: usize| bytes.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
    let header = le(14).unwrap_or(0);
    let bits = bytes.get(28..30).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let mut img = to_rgb8(decode_with_image(bytes, image::ImageFormat::Bmp, limits)?, false);
    if header >= 40 && bits == Some(16) {
        let green_bits = match (le(30), le(54), le(58), le(62)) {
            (Some(0), ..) | (Some(3), Some(0x7c00), Some(0x3e0), Some(0x1f)) => 5,
            (Some(3), Some(0xf800), Some(0x7e0), Some(0x1f)) => 6,
            _ => return Err(MediaError::UnsupportedFormat("BMP with this 16-bit bitfields layout".into())),
        };
        // The image crate rounds (v · 255 / max); its top bits give v back.
        let five = |v: u8| ((u32::from(v) >> 3) * 255 / 31) as u8;
        let six = |v: u8| ((u32::from(v) >> 2) * 255 / 63) as u8;
        for px in img.pixels_mut() {
            let [r, g, b] = px.0;
            px.0 = [five(r), if green_bits == 6 { six(g) } else { five(g) }, five(b)];
        }
    }
    Ok(img)
}

/// Pillow's first GIF frame (see the module doc), from the raw palette indices.
fn decode_gif(bytes: &[u8], p: &Probe) -> Result<RgbImage, MediaError> {
    let gif_err = |e: gif::DecodingError| bad(format!("GIF: {e}"));
    // The gif crate wants a colour table even for indexed output; an identity grey ramp
    // is what Pillow uses without one (mode L).
    let patched;
    let bytes = if bytes.get(10).is_some_and(|f| f & 0x80 == 0) {
        let mut b = bytes[..10].to_vec();
        b.extend([bytes[10] | 0x87, bytes.get(11).copied().unwrap_or(0), bytes.get(12).copied().unwrap_or(0)]);
        b.extend((0..=255u8).flat_map(|i| [i; 3]));
        b.extend(bytes.get(13..).unwrap_or_default());
        patched = b;
        &patched[..]
    } else {
        bytes
    };
    let mut options = gif::DecodeOptions::new();
    options.set_color_output(gif::ColorOutput::Indexed);
    let limit = (u64::from(p.width) * u64::from(p.height)).max(1);
    options.set_memory_limit(gif::MemoryLimit::Bytes(limit.try_into().expect("non-zero")));
    let mut decoder = options.read_info(Cursor::new(bytes)).map_err(gif_err)?;
    let global = decoder.global_palette().map(<[u8]>::to_vec);
    let frame = decoder.read_next_frame().map_err(gif_err)?.ok_or_else(|| bad("GIF without an image"))?;
    // Pillow ignores a palette that is the identity grey ramp (mode L): indices are grey levels.
    let needed = |p: &&[u8]| p.chunks_exact(3).enumerate().any(|(i, c)| c.iter().any(|&v| usize::from(v) != i));
    let palette = match &frame.palette {
        Some(local) => Some(local.as_slice()).filter(needed),
        None => global.as_deref().filter(needed),
    };
    let colour = |i: u8| -> [u8; 3] {
        match palette {
            Some(p) => p.get(3 * usize::from(i)..3 * usize::from(i) + 3).map_or([0; 3], |c| [c[0], c[1], c[2]]),
            None => [i; 3],
        }
    };
    let fill = frame.transparent.unwrap_or(0);
    let mut indices = vec![fill; p.width as usize * p.height as usize];
    let (left, top, fw) = (usize::from(frame.left), usize::from(frame.top), usize::from(frame.width));
    for (y, row) in frame.buffer.chunks_exact(fw.max(1)).enumerate() {
        let start = (top + y) * p.width as usize + left;
        let dst = indices.get_mut(start..start + row.len()).ok_or_else(|| bad("GIF frame outside its image"))?;
        dst.copy_from_slice(row);
    }
    let key = frame.transparent.map(colour);
    let rgb = indices.iter().flat_map(|&i| key.filter(|k| *k == colour(i)).map_or(colour(i), |_| [255; 3])).collect();
    RgbImage::from_raw(p.width, p.height, rgb).ok_or_else(|| bad("GIF frame outside its image"))
}
