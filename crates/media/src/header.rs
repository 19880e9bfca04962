//! Reading an image's header without decoding its pixels: format, size, EXIF orientation
//! and (PNG) the transparent colour key, each as Pillow determines them.
//!
//! This is cheap (it walks the container's segments, skipping pixel data by length) and is
//! what refuses decompression bombs: the size is known before anything is allocated.

use crate::{MediaError, orient};

/// The image formats this crate decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImageFormat {
    Png,
    Jpeg,
    Gif,
    WebP,
    Bmp,
}

impl ImageFormat {
    /// The MIME type (`image/png`, …).
    pub fn mime_type(self) -> &'static str {
        match self {
            Self::Png => "image/png",
            Self::Jpeg => "image/jpeg",
            Self::Gif => "image/gif",
            Self::WebP => "image/webp",
            Self::Bmp => "image/bmp",
        }
    }
}

/// What the header says: the format and the size of the image as transformers sees it
/// (after EXIF orientation: width and height swapped for 90° and 270° rotations).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageHeader {
    pub format: ImageFormat,
    pub width: u32,
    pub height: u32,
}

/// Everything the decoder needs from the header.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Probe {
    pub format: ImageFormat,
    /// The stored size, before orientation.
    pub width: u32,
    pub height: u32,
    /// EXIF orientation, 1…8.
    pub orientation: u8,
    pub png: Option<PngInfo>,
}

/// PNG specifics that change the RGB conversion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PngInfo {
    pub color_type: u8,
    /// transformers turns every pixel of exactly this colour white (see [`png_key`]).
    pub key: Option<[u16; 3]>,
}

fn bad(msg: impl Into<String>) -> MediaError {
    MediaError::Undecodable(msg.into())
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn be32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn le16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The format, size and orientation of an image, from its header only.
pub fn image_header(bytes: &[u8]) -> Result<ImageHeader, MediaError> {
    let p = probe(bytes)?;
    let (width, height) = if orient::swaps_axes(p.orientation) { (p.height, p.width) } else { (p.width, p.height) };
    Ok(ImageHeader { format: p.format, width, height })
}

pub(crate) fn probe(bytes: &[u8]) -> Result<Probe, MediaError> {
    if bytes.is_empty() {
        return Err(bad("no image data"));
    }
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        probe_png(bytes)
    } else if bytes.starts_with(b"\xff\xd8\xff") {
        probe_jpeg(bytes)
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        probe_gif(bytes)
    } else if bytes.starts_with(b"RIFF") && bytes.get(8..12) == Some(b"WEBP") {
        probe_webp(bytes)
    } else if bytes.starts_with(b"BM") {
        probe_bmp(bytes)
    } else {
        Err(match image::guess_format(bytes) {
            Ok(f) => MediaError::UnsupportedFormat(f.to_mime_type().into()),
            Err(_) => bad("unrecognised image format"),
        })
    }
}

fn probe_png(b: &[u8]) -> Result<Probe, MediaError> {
    const MAX_TEXT: usize = 1 << 20; // Pillow's MAX_TEXT_CHUNK
    const MAX_TEXT_MEMORY: usize = 64 << 20; // Pillow's MAX_TEXT_MEMORY: bounds the inflating work too
    let mut text_memory = 0usize;
    let mut count_text = |n: usize| {
        text_memory += n;
        if text_memory > MAX_TEXT_MEMORY { Err(bad("too much text in PNG text chunks")) } else { Ok(()) }
    };
    let (mut ihdr, mut plte, mut trns) = (None, None, None);
    let (mut exif, mut raw_profile, mut xmp_text, mut xmp_bytes): (Option<Vec<u8>>, Option<Vec<u8>>, _, _) =
        (None, None, None, None);
    let mut pos = 8;
    // Chunks after the image data count too (Pillow reads them before exif_transpose).
    while let (Some(len), Some(kind)) = (be32(b, pos), b.get(pos + 4..pos + 8)) {
        let start = pos + 8;
        let Some(data) = b.get(start..start.saturating_add(len as usize)) else { break };
        pos = start + data.len() + 4;
        match kind {
            b"IHDR" if data.len() >= 13 => ihdr = Some(data),
            _ if ihdr.is_none() => return Err(bad("PNG without an IHDR chunk first")),
            b"PLTE" => plte = Some(data),
            b"tRNS" => trns = Some(data),
            b"eXIf" => exif = Some(data.to_vec()),
            b"tEXt" => {
                let (key, value) = split_key(data);
                count_text(value.len())?;
                match key {
                    b"exif" => exif = Some(value.to_vec()),
                    b"Raw profile type exif" => raw_profile = Some(value.to_vec()),
                    b"XML:com.adobe.xmp" => xmp_text = Some(value.to_vec()),
                    _ => {}
                }
            }
            b"zTXt" => {
                let (key, value) = split_key(data);
                let (method, z) = value.split_first().map_or((0, &[][..]), |(m, z)| (*m, z));
                if method != 0 {
                    return Err(bad("unknown compression method in a PNG zTXt chunk"));
                }
                if key == b"Raw profile type exif" || key == b"XML:com.adobe.xmp" {
                    let text = inflate(z, MAX_TEXT)?.unwrap_or_default();
                    count_text(text.len())?;
                    if key == b"XML:com.adobe.xmp" { xmp_text = Some(text) } else { raw_profile = Some(text) }
                }
            }
            b"iTXt" => {
                let (key, rest) = split_key(data);
                if key != b"Raw profile type exif" && key != b"XML:com.adobe.xmp" {
                    continue;
                }
                let [flag, method, rest @ ..] = rest else { continue };
                let mut parts = rest.splitn(3, |&c| c == 0);
                let (Some(lang), Some(keyword), Some(text)) = (parts.next(), parts.next(), parts.next()) else {
                    continue;
                };
                let text = match (flag, method) {
                    (0, _) => text.to_vec(),
                    (_, 0) => match inflate(text, MAX_TEXT)? {
                        Some(t) => t,
                        None => continue,
                    },
                    _ => continue,
                };
                count_text(text.len())?;
                if key == b"XML:com.adobe.xmp" {
                    xmp_bytes = Some(text.clone());
                }
                if [lang, keyword, &text].iter().all(|t| std::str::from_utf8(t).is_ok()) {
                    if key == b"XML:com.adobe.xmp" { xmp_text = Some(text) } else { raw_profile = Some(text) }
                }
            }
            b"IEND" => break,
            _ => {}
        }
    }
    let ihdr = ihdr.ok_or_else(|| bad("PNG without an IHDR chunk"))?;
    let (width, height) = (be32(ihdr, 0).unwrap_or(0), be32(ihdr, 4).unwrap_or(0));
    let (bit_depth, color_type) = (ihdr[8], ihdr[9]);
    if let (None, Some(text)) = (&exif, raw_profile) {
        exif = Some(raw_profile_bytes(&text).ok_or_else(|| bad("invalid EXIF raw profile in a PNG text chunk"))?);
    }
    let xmp = xmp_text.filter(|t| !t.is_empty()).or(xmp_bytes);
    let key = png_key(color_type, bit_depth, plte, trns)?;
    Ok(Probe {
        format: ImageFormat::Png,
        width,
        height,
        orientation: orient::orientation(exif.as_deref(), xmp.as_deref()),
        png: Some(PngInfo { color_type, key }),
    })
}

/// `key\0rest`, or the whole chunk as the key when there is no NUL (Pillow's fallback).
fn split_key(data: &[u8]) -> (&[u8], &[u8]) {
    match data.iter().position(|&c| c == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[]),
    }
}

/// zlib-inflates at most `max` bytes: `Ok(None)` for corrupt data (Pillow ignores the
/// chunk), an error when the text is larger than `max` (Pillow refuses the image).
fn inflate(z: &[u8], max: usize) -> Result<Option<Vec<u8>>, MediaError> {
    use miniz_oxide::inflate::{TINFLStatus, decompress_to_vec_zlib_with_limit};
    match decompress_to_vec_zlib_with_limit(z, max) {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.status == TINFLStatus::HasMoreOutput => Err(bad("a PNG text chunk is too large")),
        // Pillow's decompressobj returns what it could decode of a truncated stream.
        Err(e) if e.status == TINFLStatus::FailedCannotMakeProgress => Ok(Some(e.output)),
        Err(_) => Ok(None),
    }
}

/// ImageMagick's `Raw profile type exif`: `\nexif\n<length>\n<hex…>`; lines from the
/// fourth on are hex digits (whitespace ignored).
fn raw_profile_bytes(text: &[u8]) -> Option<Vec<u8>> {
    let hex: Vec<u8> = text
        .split(|&c| c == b'\n')
        .skip(3)
        .flatten()
        .copied()
        .filter(|c| !matches!(c, b' ' | b'\t' | b'\r' | b'\x0b' | b'\x0c'))
        .collect();
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    hex.chunks_exact(2).map(|p| u8::from_str_radix(std::str::from_utf8(p).ok()?, 16).ok()).collect()
}

/// The colour that transformers turns white, for a PNG with a `tRNS` chunk.
///
/// `load_image` converts to RGB, which keeps Pillow's `transparency` info as an RGB (or
/// bare integer) colour; the processor's `convert_to_rgb` then composites over white, so
/// every pixel of exactly that colour becomes white. Pillow's quirks are kept: palette
/// images only count when one entry is fully transparent and all others opaque (Python's
/// `$` also accepts a final newline byte); low-bit grey keys are compared unscaled; a
/// 16-bit colour key is compared, unscaled, against the 8-bit high bytes; a 1- or 16-bit
/// grey key becomes the colour `(k, 0, 0)`, which only matches black, when `k` is 0.
fn png_key(
    color_type: u8,
    depth: u8,
    plte: Option<&[u8]>,
    trns: Option<&[u8]>,
) -> Result<Option<[u16; 3]>, MediaError> {
    let Some(t) = trns else { return Ok(None) };
    Ok(match color_type {
        3 => {
            let body = t.strip_suffix(b"\n").unwrap_or(t);
            let simple = body.iter().filter(|&&c| c == 0).count() == 1 && body.iter().all(|&c| c == 0 || c == 0xff);
            let index = t.iter().position(|&c| c == 0).filter(|_| simple);
            index.map(|i| {
                let rgb = plte.and_then(|p| p.get(3 * i..3 * i + 3)).unwrap_or(&[0, 0, 0]);
                [rgb[0], rgb[1], rgb[2]].map(u16::from)
            })
        }
        0 | 2 if t.len() < if color_type == 2 { 6 } else { 2 } => return Err(bad("truncated PNG tRNS chunk")),
        0 => {
            let k = be16(t, 0).unwrap_or(0);
            match depth {
                1 | 16 => (k == 0).then_some([0; 3]),
                // Pillow clamps an out-of-range key to 255.
                _ => Some([k.min(255); 3]),
            }
        }
        2 => Some([be16(t, 0), be16(t, 2), be16(t, 4)].map(|v| v.unwrap_or(0))),
        _ => None,
    })
}

fn probe_jpeg(b: &[u8]) -> Result<Probe, MediaError> {
    let mut pos = 2;
    let mut size: Option<(u32, u32)> = None;
    let (mut exif, mut xmp): (Option<Vec<u8>>, Option<&[u8]>) = (None, None);
    // Pillow skips junk between segments and 0xFF fill bytes.
    while let Some(ff) = b[pos..].iter().position(|&c| c == 0xff) {
        pos += ff + 1;
        let Some(&marker) = b.get(pos) else { break };
        pos += 1;
        match marker {
            0x00 | 0xff => {
                pos -= usize::from(marker == 0xff);
                continue;
            }
            0xda => {
                let (w, h) = size.ok_or_else(|| bad("JPEG without a frame header before the scan"))?;
                let exif = exif.as_deref();
                return Ok(Probe {
                    format: ImageFormat::Jpeg,
                    width: w,
                    height: h,
                    orientation: orient::orientation(exif, xmp),
                    png: None,
                });
            }
            0xc8 | 0xd0..=0xd9 | 0xf0..=0xfd => continue, // no payload
            0xc0..=0xcf | 0xdb..=0xdf | 0xe0..=0xef | 0xfe => {}
            _ => return Err(bad(format!("JPEG: unknown marker 0xFF{marker:02X}"))),
        }
        let len = usize::from(be16(b, pos).ok_or_else(|| bad("truncated JPEG header"))?);
        let seg = b.get(pos + 2..pos + len.max(2)).ok_or_else(|| bad("truncated JPEG header"))?;
        pos += len.max(2);
        match marker {
            0xc4 | 0xc8 | 0xcc => {}
            0xc0..=0xcf | 0xde => {
                let (Some(&bits), Some(h), Some(w), Some(&layers)) =
                    (seg.first(), be16(seg, 1), be16(seg, 3), seg.get(5))
                else {
                    return Err(bad("truncated JPEG frame header"));
                };
                if bits != 8 {
                    return Err(MediaError::UnsupportedFormat(format!("{bits}-bit JPEG")));
                }
                if !matches!(layers, 1 | 3 | 4) {
                    return Err(MediaError::UnsupportedFormat(format!("JPEG with {layers} components")));
                }
                size = Some((u32::from(w), u32::from(h)));
            }
            0xe1 if seg.starts_with(b"Exif\0\0") => match &mut exif {
                Some(e) => e.extend_from_slice(&seg[6..]),
                None => exif = Some(seg.to_vec()),
            },
            0xe1 if seg.starts_with(b"http://ns.adobe.com/xap/1.0/\0") => xmp = Some(&seg[29..]),
            _ => {}
        }
    }
    Err(bad("truncated JPEG: no image data"))
}

fn probe_gif(b: &[u8]) -> Result<Probe, MediaError> {
    let truncated = || bad("truncated GIF");
    let (sw, sh) = (le16(b, 6).ok_or_else(truncated)?, le16(b, 8).ok_or_else(truncated)?);
    let flags = *b.get(10).ok_or_else(truncated)?;
    let mut pos = 13 + if flags & 0x80 != 0 { 3usize << ((flags & 7) + 1) } else { 0 };
    while let Some(&c) = b.get(pos) {
        pos += 1;
        match c {
            b'!' => {
                pos += 1; // label
                while let Some(&n) = b.get(pos) {
                    pos += 1 + usize::from(n);
                    if n == 0 {
                        break;
                    }
                }
            }
            b',' => {
                let (x, y) = (le16(b, pos).ok_or_else(truncated)?, le16(b, pos + 2).ok_or_else(truncated)?);
                let (w, h) = (le16(b, pos + 4).ok_or_else(truncated)?, le16(b, pos + 6).ok_or_else(truncated)?);
                // Pillow grows the image to hold a first frame that reaches past the screen.
                let width = u32::from(sw).max(u32::from(x) + u32::from(w));
                let height = u32::from(sh).max(u32::from(y) + u32::from(h));
                return Ok(Probe { format: ImageFormat::Gif, width, height, orientation: 1, png: None });
            }
            b';' => break,
            _ => {} // Pillow skips stray bytes between blocks
        }
    }
    Err(bad("GIF without an image"))
}

fn probe_webp(b: &[u8]) -> Result<Probe, MediaError> {
    // libwebp's demuxer refuses a file shorter than its RIFF header says.
    if le32(b, 4).is_none_or(|n| b.len() < 8 + n as usize) {
        return Err(bad("truncated WebP"));
    }
    let mut pos = 12;
    let (mut size, mut extended, mut exif, mut xmp) = (None, false, None, None);
    while let (Some(kind), Some(len)) = (b.get(pos..pos + 4), le32(b, pos + 4)) {
        let start = pos + 8;
        let data = &b[start..start.saturating_add(len as usize).min(b.len())];
        let first = pos == 12;
        pos = start.saturating_add(len as usize).saturating_add(len as usize & 1);
        let dims = match kind {
            b"VP8X" if first => {
                extended = true;
                let d = |at: usize| data.get(at..at + 3).map(|s| u32::from_le_bytes([s[0], s[1], s[2], 0]) + 1);
                d(4).zip(d(7))
            }
            b"VP8 " if first && data.get(3..6) == Some(b"\x9d\x01\x2a") => {
                le16(data, 6).zip(le16(data, 8)).map(|(w, h)| (u32::from(w & 0x3fff), u32::from(h & 0x3fff)))
            }
            b"VP8L" if first && data.first() == Some(&0x2f) => {
                le32(data, 1).map(|bits| ((bits & 0x3fff) + 1, ((bits >> 14) & 0x3fff) + 1))
            }
            b"EXIF" if extended => {
                exif = Some(data);
                None
            }
            b"XMP " if extended => {
                xmp = Some(data);
                None
            }
            _ if first => return Err(bad("WebP without an image header")),
            _ => None,
        };
        size = size.or(dims);
        if !extended {
            break;
        }
    }
    let (width, height) = size.ok_or_else(|| bad("truncated WebP header"))?;
    Ok(Probe { format: ImageFormat::WebP, width, height, orientation: orient::orientation(exif, xmp), png: None })
}

fn probe_bmp(b: &[u8]) -> Result<Probe, MediaError> {
    let truncated = || bad("truncated BMP header");
    let (width, height) = match le32(b, 14).ok_or_else(truncated)? {
        12 => (u32::from(le16(b, 18).ok_or_else(truncated)?), u32::from(le16(b, 20).ok_or_else(truncated)?)),
        // Pillow reads both as unsigned; a height whose top byte is 0xFF is top-down.
        40 | 52 | 56 | 64 | 108 | 124 => {
            let (w, h) = (le32(b, 18).ok_or_else(truncated)?, le32(b, 22).ok_or_else(truncated)?);
            (w, if h >> 24 == 0xff { h.wrapping_neg() } else { h })
        }
        n => return Err(MediaError::UnsupportedFormat(format!("BMP with a {n}-byte header"))),
    };
    Ok(Probe { format: ImageFormat::Bmp, width, height, orientation: 1, png: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_keys() {
        let plte: Vec<u8> = (0..30).collect();
        let key = |ct, depth, trns: &[u8]| png_key(ct, depth, Some(&plte), Some(trns)).unwrap();
        assert_eq!(key(3, 8, b"\xff\x00\xff"), Some([3, 4, 5]));
        assert_eq!(key(3, 8, b"\xff\x00\n"), Some([3, 4, 5]), "Python's `$` before a final newline");
        assert_eq!(key(3, 8, b"\xff\x00\x80"), None, "alpha values per entry");
        assert_eq!(key(3, 8, b"\xff\xff"), None);
        assert_eq!(key(3, 8, b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x00"), Some([0; 3]), "past the palette");
        assert_eq!(key(0, 8, b"\x00\x07"), Some([7; 3]));
        assert_eq!(key(0, 2, b"\x00\x01"), Some([1; 3]));
        assert_eq!(key(0, 16, b"\x00\x05"), None);
        assert_eq!(key(0, 16, b"\x00\x00"), Some([0; 3]));
        assert_eq!(key(0, 1, b"\x00\x01"), None);
        assert_eq!(key(2, 16, b"\x01\x02\x00\x03\x00\x04"), Some([258, 3, 4]));
        assert_eq!(key(6, 8, b"\x00\x01"), None);
        assert!(png_key(2, 8, None, Some(b"\0\0")).is_err());
    }

    #[test]
    fn raw_profile() {
        assert_eq!(raw_profile_bytes(b"\nexif\n       4\n4578 69\n66\n"), Some(b"Exif".to_vec()));
        assert_eq!(raw_profile_bytes(b"\nexif\n       4\n45x8\n"), None);
        assert_eq!(raw_profile_bytes(b"\nexif\n"), Some(vec![]));
    }
}
