use std::io::Cursor;

use image::{DynamicImage, ImageBuffer, ImageFormat, Luma, LumaA, Rgb, Rgba};
use mmserve_media::{ImageLimits, MediaError, decode_image, image_dimensions};

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend((data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend(kind);
    out.extend(data);
    let crc = crc32(&out[start..]);
    out.extend(crc.to_be_bytes());
}

/// A PNG with a valid header claiming `w×h` RGB pixels and no image data.
fn png_header_only(w: u32, h: u32) -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend(w.to_be_bytes());
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    chunk(&mut png, b"IHDR", &ihdr);
    chunk(&mut png, b"IDAT", &[]);
    chunk(&mut png, b"IEND", &[]);
    png
}

fn encode(img: impl Into<DynamicImage>, format: ImageFormat) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    img.into().write_to(&mut out, format).unwrap();
    out.into_inner()
}

#[test]
fn crc_is_right() {
    assert_eq!(crc32(b"IEND"), 0xAE42_6082);
}

#[test]
fn huge_header_refused_before_decoding() {
    let png = png_header_only(100_000, 100_000);
    assert_eq!(image_dimensions(&png).unwrap(), (100_000, 100_000));
    let err = decode_image(&png, &ImageLimits::default()).unwrap_err();
    assert_eq!(err, MediaError::TooLarge { width: 100_000, height: 100_000, max_pixels: 178_956_970 });
    assert!(err.to_string().contains("100000x100000"), "{err}");
    // A small limit applies too.
    let small = encode(Rgb::<u8>([1, 2, 3]).to_image(20, 10), ImageFormat::Png);
    let err = decode_image(&small, &ImageLimits { max_pixels: 199 }).unwrap_err();
    assert!(matches!(err, MediaError::TooLarge { width: 20, height: 10, .. }), "{err:?}");
    assert!(decode_image(&small, &ImageLimits { max_pixels: 200 }).is_ok());
}

trait ToImage {
    fn to_image(self, w: u32, h: u32) -> image::RgbImage;
}
impl ToImage for Rgb<u8> {
    fn to_image(self, w: u32, h: u32) -> image::RgbImage {
        ImageBuffer::from_pixel(w, h, self)
    }
}

#[test]
fn garbage_and_empty_refused() {
    let err = decode_image(b"this is not an image at all", &ImageLimits::default()).unwrap_err();
    assert!(matches!(err, MediaError::Undecodable(_)), "{err:?}");
    let err = decode_image(&[], &ImageLimits::default()).unwrap_err();
    assert!(matches!(err, MediaError::Undecodable(_)), "{err:?}");
    assert!(image_dimensions(&[]).is_err());
    // A valid header whose data is missing.
    let err = decode_image(&png_header_only(4, 4), &ImageLimits::default()).unwrap_err();
    assert!(matches!(err, MediaError::Undecodable(_)), "{err:?}");
    // A truncated real PNG.
    let png = encode(Rgb::<u8>([9, 8, 7]).to_image(64, 64), ImageFormat::Png);
    assert!(decode_image(&png[..png.len() / 2], &ImageLimits::default()).is_err());
}

#[test]
fn unsupported_format_named() {
    // TIFF magic: recognised, but not compiled in.
    let err = decode_image(b"II*\0\x08\0\0\0\0\0\0\0", &ImageLimits::default()).unwrap_err();
    assert!(matches!(err, MediaError::UnsupportedFormat(_)), "{err:?}");
    assert!(err.to_string().contains("tiff"), "{err}");
}

#[test]
fn zero_sized_refused() {
    let png = png_header_only(0, 5);
    assert!(decode_image(&png, &ImageLimits::default()).is_err());
}

#[test]
fn alpha_dropped_not_composited() {
    let rgba = ImageBuffer::from_fn(3, 2, |x, y| Rgba([x as u8 * 50, y as u8 * 60, 7, (x * 100) as u8]));
    let img = decode_image(&encode(rgba.clone(), ImageFormat::Png), &ImageLimits::default()).unwrap();
    for (x, y, p) in img.enumerate_pixels() {
        let q = rgba.get_pixel(x, y);
        assert_eq!(p.0, [q[0], q[1], q[2]]);
    }
}

#[test]
fn grey_replicated() {
    let grey = ImageBuffer::from_fn(4, 3, |x, y| Luma([(x * 40 + y) as u8]));
    let img = decode_image(&encode(grey.clone(), ImageFormat::Png), &ImageLimits::default()).unwrap();
    for (x, y, p) in img.enumerate_pixels() {
        assert_eq!(p.0, [grey.get_pixel(x, y)[0]; 3]);
    }
    let grey_alpha = ImageBuffer::from_fn(4, 3, |x, _| LumaA([(x * 40) as u8, 0]));
    let img = decode_image(&encode(grey_alpha, ImageFormat::Png), &ImageLimits::default()).unwrap();
    assert_eq!(img.get_pixel(3, 2).0, [120; 3]);
}

#[test]
fn sixteen_bit_png_like_pil() {
    // Grey I;16 clamps; RGB16 keeps the high byte.
    let grey = ImageBuffer::from_fn(3, 1, |x, _| Luma([[7u16, 300, 0x8100][x as usize]]));
    let img = decode_image(&encode(grey, ImageFormat::Png), &ImageLimits::default()).unwrap();
    assert_eq!(img.as_raw(), &[7, 7, 7, 255, 255, 255, 255, 255, 255]);
    let rgb = ImageBuffer::from_pixel(1, 1, Rgb([0x80FFu16, 0x0101, 0xFFFF]));
    let img = decode_image(&encode(rgb, ImageFormat::Png), &ImageLimits::default()).unwrap();
    assert_eq!(img.as_raw(), &[0x80, 0x01, 0xFF]);
}

#[test]
fn other_formats_decode() {
    let src = ImageBuffer::from_fn(5, 4, |x, y| Rgb([x as u8 * 10, y as u8 * 20, 200]));
    for format in [ImageFormat::Bmp, ImageFormat::Png] {
        let img = decode_image(&encode(src.clone(), format), &ImageLimits::default()).unwrap();
        assert_eq!(img, src, "{format:?}");
    }
    let jpeg = encode(src.clone(), ImageFormat::Jpeg);
    assert_eq!(image_dimensions(&jpeg).unwrap(), (5, 4));
    assert_eq!(decode_image(&jpeg, &ImageLimits::default()).unwrap().dimensions(), (5, 4));
}

/// Headers that claim huge images, with (almost) no data: refused from the header alone,
/// in microseconds, by `decode_image`; `image_header` reports the size.
#[test]
fn decompression_bombs_refused_from_the_header() {
    use mmserve_media::{ImageFormat, image_header};
    let jpeg = {
        let mut j = vec![0xff, 0xd8];
        j.extend([0xff, 0xc0, 0, 17, 8, 0xff, 0xff, 0xff, 0xff, 3, 1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1]);
        j.extend([0xff, 0xda, 0, 12, 3, 1, 0, 2, 0x11, 3, 0x11, 0, 63, 0]);
        j.extend([0xff, 0xd9]);
        j
    };
    let gif = {
        let mut g = b"GIF89a\xff\xff\xff\xff\x00\x00\x00".to_vec();
        g.extend(b",\0\0\0\0\xff\xff\xff\xff\x00\x08\x01\x00\x00;");
        g
    };
    let webp = {
        let mut w = b"RIFF\x16\0\0\0WEBPVP8X\x0a\0\0\0\0\0\0\0".to_vec();
        w.extend([0xff, 0x3f, 0, 0xff, 0x3f, 0]); // 16384 × 16384
        w
    };
    let bmp = {
        let mut b = b"BM\0\0\0\0\0\0\0\0\x36\0\0\0\x28\0\0\0".to_vec();
        b.extend(100_000u32.to_le_bytes());
        b.extend(100_000u32.to_le_bytes());
        b.extend([1, 0, 24, 0]);
        b.extend([0; 24]);
        b
    };
    let cases = [
        (png_header_only(100_000, 100_000), ImageFormat::Png, 100_000, 100_000),
        (jpeg, ImageFormat::Jpeg, 65_535, 65_535),
        (gif, ImageFormat::Gif, 65_535, 65_535),
        (webp, ImageFormat::WebP, 16_384, 16_384),
        (bmp, ImageFormat::Bmp, 100_000, 100_000),
    ];
    let start = std::time::Instant::now();
    for (bytes, format, width, height) in &cases {
        assert!(bytes.len() < 200, "{format:?}");
        let h = image_header(bytes).unwrap();
        assert_eq!((h.format, h.width, h.height), (*format, *width, *height));
        let err = decode_image(bytes, &ImageLimits::default()).unwrap_err();
        assert!(matches!(err, MediaError::TooLarge { .. }), "{format:?}: {err:?}");
    }
    let per_call = start.elapsed() / cases.len() as u32;
    println!("header check of a bomb: {per_call:?}");
    assert!(per_call < std::time::Duration::from_millis(5), "{per_call:?}");
}
