//! EXIF orientation as Pillow reads it (`Image.getexif()` → `ImageOps.exif_transpose`).
//!
//! Pillow takes the Orientation tag (0x0112) from IFD0 of the EXIF block; the first entry
//! with that tag counts, its first value is used, and a numeric type is required (SHORT,
//! LONG, the signed ones, RATIONAL, FLOAT, …: BYTE, ASCII and UNDEFINED values never
//! compare equal to 2…8). Malformed EXIF is ignored. Only when the EXIF has no Orientation
//! tag is XMP consulted: the first `tiff:Orientation="N"` or `tiff:Orientation>N`.

use image::{DynamicImage, RgbImage, metadata::Orientation};

/// Strips Pillow's `Exif\0\0` prefixes (any number of them).
fn strip_exif_prefix(mut data: &[u8]) -> &[u8] {
    while let Some(rest) = data.strip_prefix(b"Exif\0\0") {
        data = rest;
    }
    data
}

/// The Orientation tag of an EXIF block: `None` when the block or the tag is missing or
/// unreadable; `Some(v)` with the numeric value otherwise (any value, even one outside 1…8,
/// which suppresses the XMP fallback without transposing).
pub(crate) fn exif_orientation(data: &[u8]) -> Option<f64> {
    let tiff = strip_exif_prefix(data);
    let big = match tiff.get(..4)? {
        b"MM\0*" | b"MM*\0" => true,
        b"II*\0" | b"II\0*" => false,
        _ => return None,
    };
    let u16_at = |at: usize| -> Option<u16> {
        let b: [u8; 2] = tiff.get(at..at.checked_add(2)?)?.try_into().ok()?;
        Some(if big { u16::from_be_bytes(b) } else { u16::from_le_bytes(b) })
    };
    let u32_at = |at: usize| -> Option<u32> {
        let b: [u8; 4] = tiff.get(at..at.checked_add(4)?)?.try_into().ok()?;
        Some(if big { u32::from_be_bytes(b) } else { u32::from_le_bytes(b) })
    };
    let ifd = u32_at(4)? as usize;
    let count = u16_at(ifd)?;
    // Pillow's ImageFileDirectory_v2.load: an entry that cannot be read ends the directory
    // (the tags read so far are kept); an entry whose data lies past the end is skipped or,
    // when its offset points past the end, ends the directory too.
    let mut found = None;
    let mut total = 0u64;
    for i in 0..usize::from(count) {
        let entry = ifd + 2 + 12 * i;
        if tiff.len() < entry + 12 {
            break;
        }
        let (tag, typ, n) = (u16_at(entry)?, u16_at(entry + 2)?, u32_at(entry + 4)?);
        let unit: u64 = match typ {
            1 | 2 | 6 | 7 => 1,
            3 | 8 => 2,
            4 | 9 | 11 | 13 => 4,
            5 | 10 | 12 | 16 => 8,
            _ => continue,
        };
        let size = u64::from(n) * unit;
        let at = if size > 4 {
            total += size;
            if total > tiff.len() as u64 {
                continue;
            }
            let at = u64::from(u32_at(entry + 8)?);
            if at + size > tiff.len() as u64 {
                break;
            }
            at as usize
        } else {
            entry + 8
        };
        if size > 0 && tag == 0x0112 && found.is_none() {
            found = Some((typ, at));
        }
    }
    let (typ, v) = found?;
    let i32_at = |at| u32_at(at).map(|x| x as i32);
    Some(match typ {
        3 => f64::from(u16_at(v)?),
        8 => f64::from(u16_at(v)? as i16),
        6 => f64::from(tiff[v] as i8),
        4 | 13 => f64::from(u32_at(v)?),
        9 => f64::from(i32_at(v)?),
        11 => f64::from(f32::from_bits(u32_at(v)?)),
        12 | 16 => {
            let (hi, lo) = (u64::from(u32_at(v)?), u64::from(u32_at(v + 4)?));
            let bits = if big { hi << 32 | lo } else { lo << 32 | hi };
            if typ == 12 { f64::from_bits(bits) } else { bits as f64 }
        }
        5 => f64::from(u32_at(v)?) / f64::from(u32_at(v + 4)?),
        10 => f64::from(i32_at(v)?) / f64::from(i32_at(v + 4)?),
        // BYTE, ASCII, UNDEFINED: present, but never an integer to Pillow.
        _ => f64::NAN,
    })
}

/// Pillow's XMP fallback: the first `tiff:Orientation="D"` or `tiff:Orientation>D`.
pub(crate) fn xmp_orientation(xmp: &[u8]) -> Option<u8> {
    const KEY: &[u8] = b"tiff:Orientation";
    let mut from = 0;
    while let Some(pos) = xmp[from..].windows(KEY.len()).position(|w| w == KEY) {
        let rest = &xmp[from + pos + KEY.len()..];
        let digit = match rest {
            [b'=', b'"', d, ..] | [b'>', d, ..] if d.is_ascii_digit() => Some(d - b'0'),
            _ => None,
        };
        if digit.is_some() {
            return digit;
        }
        from += pos + 1;
    }
    None
}

/// The orientation to apply (1…8), from an EXIF block and an XMP packet as Pillow combines them.
pub(crate) fn orientation(exif: Option<&[u8]>, xmp: Option<&[u8]>) -> u8 {
    let value = match exif.and_then(exif_orientation) {
        Some(v) => Some(v),
        None => xmp.and_then(xmp_orientation).map(f64::from),
    };
    match value {
        Some(v) if v.fract() == 0.0 && (2.0..=8.0).contains(&v) => v as u8,
        _ => 1,
    }
}

/// Whether the orientation swaps width and height.
pub(crate) fn swaps_axes(orientation: u8) -> bool {
    orientation >= 5
}

/// `ImageOps.exif_transpose` for an orientation value 1…8.
pub(crate) fn apply(img: RgbImage, orientation: u8) -> RgbImage {
    match Orientation::from_exif(orientation) {
        Some(o) if o != Orientation::NoTransforms => {
            let mut img = DynamicImage::ImageRgb8(img);
            img.apply_orientation(o);
            img.into_rgb8()
        }
        _ => img,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ifd(big: bool, entries: &[(u16, u16, u32, [u8; 4])]) -> Vec<u8> {
        let mut out = b"Exif\0\0".to_vec();
        let p16 = |v: u16| if big { v.to_be_bytes() } else { v.to_le_bytes() };
        let p32 = |v: u32| if big { v.to_be_bytes() } else { v.to_le_bytes() };
        out.extend(if big { b"MM\0*" } else { b"II*\0" });
        out.extend(p32(8));
        out.extend(p16(entries.len() as u16));
        for &(tag, typ, n, v) in entries {
            out.extend(p16(tag));
            out.extend(p16(typ));
            out.extend(p32(n));
            out.extend(v);
        }
        out.extend([0; 4]);
        out
    }

    #[test]
    fn exif_values() {
        let short = |v: u16| {
            let b = v.to_le_bytes();
            [b[0], b[1], 0, 0]
        };
        assert_eq!(orientation(Some(&ifd(false, &[(0x0112, 3, 1, short(6))])), None), 6);
        assert_eq!(orientation(Some(&ifd(true, &[(0x0112, 3, 1, [0, 8, 0, 0])])), None), 8);
        assert_eq!(orientation(Some(&ifd(false, &[(0x0112, 4, 1, 3u32.to_le_bytes())])), None), 3);
        // First entry wins; value 9 or 1 means no rotation and no XMP fallback.
        let two = ifd(false, &[(0x0112, 3, 1, short(9)), (0x0112, 3, 1, short(6))]);
        assert_eq!(orientation(Some(&two), Some(b"tiff:Orientation=\"6\"")), 1);
        // BYTE is not a number to Pillow; unknown types are skipped.
        assert_eq!(orientation(Some(&ifd(false, &[(0x0112, 1, 1, [6, 0, 0, 0])])), None), 1);
        assert_eq!(orientation(Some(&ifd(false, &[(0x0112, 99, 1, [6, 0, 0, 0]), (0x0112, 3, 1, short(5))])), None), 5);
        // Garbage, truncation and missing tags fall back to XMP.
        for bad in [&b"Exif\0\0garbage"[..], b"", b"II*\0\xff\0\0\0", &ifd(false, &[(0x0110, 3, 1, short(6))])] {
            assert_eq!(orientation(Some(bad), None), 1);
            assert_eq!(orientation(Some(bad), Some(b"x tiff:Orientation>7<")), 7);
        }
        assert_eq!(orientation(None, Some(b"tiff:Orientation=\"x\" tiff:Orientation=\"2\"")), 2);
        assert_eq!(orientation(None, Some(b"tiff:Orientation")), 1);
    }
}
