//! transformers' `CLIPImageProcessor` (PIL backend) from `preprocessor_config.json`:
//! resize (shortest edge, PIL bicubic), centre crop, rescale, normalise, CHW f32.
//!
//! Only the crop window of the resized image is computed (exactly the same pixels:
//! see [`crate::resample`]), so elongated images cost no more than square ones.

use image::RgbImage;
use serde_json::{Map, Value};

use crate::{MediaError, resample::resize_bicubic_window};

pub(crate) const OPENAI_CLIP_MEAN: [f64; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
pub(crate) const OPENAI_CLIP_STD: [f64; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];
/// PIL's `Image.BICUBIC`.
pub(crate) const PIL_BICUBIC: u64 = 3;
/// PIL stores sizes in C ints.
pub(crate) const MAX_SIDE: u64 = i32::MAX as u64;

/// How `size` resizes an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resize {
    /// The shorter side becomes `n`; the longer one `int(n * long / short)`.
    ShortestEdge(u32),
    /// Exactly this size, ignoring the aspect ratio.
    Exact { height: u32, width: u32 },
}

/// A `CLIPImageProcessor`'s settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ClipImageProcessor {
    resize: Option<Resize>,
    /// `(height, width)`.
    crop: Option<(u32, u32)>,
    rescale: Option<f64>,
    normalize: Option<([f32; 3], [f32; 3])>,
    convert_rgb: bool,
}

pub(crate) fn bad(msg: impl Into<String>) -> MediaError {
    MediaError::BadConfig(msg.into())
}

/// The field, treating `null` as absent.
pub(crate) fn field<'a>(cfg: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    cfg.get(key).filter(|v| !v.is_null())
}

pub(crate) fn flag(cfg: &Map<String, Value>, key: &str) -> Result<bool, MediaError> {
    field(cfg, key).map_or(Ok(true), |v| v.as_bool().ok_or_else(|| bad(format!("`{key}` must be a boolean"))))
}

fn side(v: &Value, what: &str) -> Result<u32, MediaError> {
    v.as_u64()
        .filter(|&n| n > 0 && n <= MAX_SIDE)
        .map(|n| n as u32)
        .ok_or_else(|| bad(format!("`{what}` must be a positive integer")))
}

/// `{"height": h, "width": w}` (exactly those keys), or `None` for another object.
fn height_width(m: &Map<String, Value>, key: &str) -> Result<Option<(u32, u32)>, MediaError> {
    match (m.get("height"), m.get("width"), m.len()) {
        (Some(h), Some(w), 2) => Ok(Some((side(h, &format!("{key}.height"))?, side(w, &format!("{key}.width"))?))),
        _ => Ok(None),
    }
}

fn parse_size(v: &Value) -> Result<Resize, MediaError> {
    let unsupported = || bad(format!("unsupported `size`: {v}"));
    match v {
        Value::Number(_) => Ok(Resize::ShortestEdge(side(v, "size")?)),
        Value::Object(m) => {
            if let Some((height, width)) = height_width(m, "size")? {
                return Ok(Resize::Exact { height, width });
            }
            match (m.get("shortest_edge"), m.len()) {
                (Some(n), 1) => Ok(Resize::ShortestEdge(side(n, "size.shortest_edge")?)),
                _ => Err(unsupported()),
            }
        }
        _ => Err(unsupported()),
    }
}

fn parse_crop(v: &Value) -> Result<(u32, u32), MediaError> {
    match v {
        Value::Number(_) => side(v, "crop_size").map(|n| (n, n)),
        Value::Object(m) => height_width(m, "crop_size")?.ok_or_else(|| bad(format!("unsupported `crop_size`: {v}"))),
        _ => Err(bad(format!("unsupported `crop_size`: {v}"))),
    }
}

pub(crate) fn parse_triple(cfg: &Map<String, Value>, key: &str, default: [f64; 3]) -> Result<[f32; 3], MediaError> {
    let err = || bad(format!("`{key}` must be a number or a list of 3 numbers"));
    let Some(v) = field(cfg, key) else {
        return Ok(default.map(|x| x as f32));
    };
    let t = match v {
        Value::Number(n) => [n.as_f64().ok_or_else(err)?; 3],
        Value::Array(a) if a.len() == 3 => {
            let mut t = [0.0; 3];
            for (t, x) in t.iter_mut().zip(a) {
                *t = x.as_f64().ok_or_else(err)?;
            }
            t
        }
        _ => return Err(err()),
    };
    // numpy casts mean and std to the image's dtype, float32.
    Ok(t.map(|x| x as f32))
}

/// Only PIL's bicubic (3, the default) is implemented.
pub(crate) fn check_resample(cfg: &Map<String, Value>) -> Result<(), MediaError> {
    let resample = field(cfg, "resample").map_or(Some(PIL_BICUBIC), Value::as_u64);
    if resample != Some(PIL_BICUBIC) {
        return Err(bad(format!(
            "resample mode {} is not supported (only 3, bicubic)",
            field(cfg, "resample").unwrap_or(&Value::Null)
        )));
    }
    Ok(())
}

/// How a u8 level becomes a value: rescale factor, and mean and std.
pub(crate) type Levels = (Option<f64>, Option<([f32; 3], [f32; 3])>);

/// `do_rescale`, `rescale_factor`, `do_normalize`, `image_mean`, `image_std`.
pub(crate) fn parse_levels(cfg: &Map<String, Value>) -> Result<Levels, MediaError> {
    let rescale = match flag(cfg, "do_rescale")? {
        true => {
            let f = field(cfg, "rescale_factor").map_or(Some(1.0 / 255.0), Value::as_f64);
            Some(f.filter(|f| f.is_finite()).ok_or_else(|| bad("`rescale_factor` must be a number"))?)
        }
        false => None,
    };
    let normalize = match flag(cfg, "do_normalize")? {
        true => {
            let mean = parse_triple(cfg, "image_mean", OPENAI_CLIP_MEAN)?;
            let std = parse_triple(cfg, "image_std", OPENAI_CLIP_STD)?;
            if std.contains(&0.0) || mean.iter().chain(&std).any(|x| !x.is_finite()) {
                return Err(bad("`image_mean` and `image_std` must be finite, and `image_std` non-zero"));
            }
            Some((mean, std))
        }
        false => None,
    };
    Ok((rescale, normalize))
}

/// Per channel, transformers' f32 value of each u8 level: `f32(level · factor)` (the
/// product in f64), then `(x - mean) / std` in f32.
pub(crate) fn level_table((rescale, normalize): Levels) -> [[f32; 256]; 3] {
    std::array::from_fn(|c| {
        std::array::from_fn(|v| {
            let mut x = match rescale {
                Some(f) => (v as f64 * f) as f32,
                None => v as f32,
            };
            if let Some((mean, std)) = normalize {
                x = (x - mean[c]) / std[c];
            }
            x
        })
    })
}

/// A canonical text of the level mapping, for fingerprints.
pub(crate) fn levels_fingerprint((rescale, normalize): Levels) -> String {
    let rescale = rescale.map_or("none".into(), |f| format!("{f:?}"));
    let normalize = normalize.map_or("none".into(), |(m, s)| format!("mean{m:?}std{s:?}"));
    format!("rescale={rescale};normalize={normalize}")
}

/// floor((full - crop) / 2): the crop's first row (or column) in the resized image;
/// negative when the crop is larger and transformers pads with zeros.
fn crop_offset(full: u64, crop: u32) -> i64 {
    (full as i64 - i64::from(crop)).div_euclid(2)
}

impl ClipImageProcessor {
    /// Reads a `preprocessor_config.json`. Missing fields take `CLIPImageProcessor`'s
    /// defaults (224 shortest edge, 224×224 crop, 1/255, OpenAI CLIP mean and std).
    pub fn from_json(cfg: &Value) -> Result<Self, MediaError> {
        let cfg = cfg.as_object().ok_or_else(|| bad("the config must be a JSON object"))?;
        if let Some(t) = field(cfg, "image_processor_type") {
            let t = t.as_str().unwrap_or_default();
            if !t.starts_with("CLIPImageProcessor") {
                return Err(bad(format!("image processor type {t:?} is not supported (only CLIPImageProcessor)")));
            }
        }
        check_resample(cfg)?;
        let resize = match flag(cfg, "do_resize")? {
            true => Some(field(cfg, "size").map_or(Ok(Resize::ShortestEdge(224)), parse_size)?),
            false => None,
        };
        let crop = match flag(cfg, "do_center_crop")? {
            true => Some(field(cfg, "crop_size").map_or(Ok((224, 224)), parse_crop)?),
            false => None,
        };
        if crop.is_none() && !matches!(resize, Some(Resize::Exact { .. })) {
            return Err(bad(
                "without a centre crop, `size` must be {\"height\", \"width\"} (the output size must not depend on the image)",
            ));
        }
        let (rescale, normalize) = parse_levels(cfg)?;
        Ok(Self { resize, crop, rescale, normalize, convert_rgb: flag(cfg, "do_convert_rgb")? })
    }

    /// `(height, width)` of every output image.
    pub fn output_size(&self) -> (usize, usize) {
        match (self.crop, self.resize) {
            (Some((h, w)), _) | (None, Some(Resize::Exact { height: h, width: w })) => (h as usize, w as usize),
            _ => unreachable!("from_json ensures a fixed output size"),
        }
    }

    /// A canonical description of every setting that affects the output, stable
    /// across processes and builds (for cache keys). Includes a version tag of the
    /// algorithm, to be bumped if the output of this crate ever changes.
    pub fn fingerprint(&self) -> String {
        let resize = match self.resize {
            Some(Resize::ShortestEdge(n)) => format!("shortest_edge:{n}"),
            Some(Resize::Exact { height, width }) => format!("{height}x{width}"),
            None => "none".into(),
        };
        let crop = self.crop.map_or("none".into(), |(h, w)| format!("{h}x{w}"));
        format!(
            "clip-pil-v1;convert_rgb={};resize={resize};resample=bicubic;crop={crop};{}",
            self.convert_rgb,
            levels_fingerprint((self.rescale, self.normalize))
        )
    }

    /// `(height, width)` of the resize (before the crop) for an image of this size, or why
    /// it cannot be preprocessed; needs only the header's size.
    pub fn resized_size(&self, width: u32, height: u32) -> Result<(u64, u64), MediaError> {
        if width == 0 || height == 0 {
            return Err(MediaError::ZeroSized);
        }
        // transformers' get_resize_output_image_size(default_to_square=False).
        let (rh, rw) = match self.resize {
            None => (u64::from(height), u64::from(width)),
            Some(Resize::Exact { height, width }) => (u64::from(height), u64::from(width)),
            Some(Resize::ShortestEdge(n)) => {
                let (short, long) = (width.min(height), width.max(height));
                let new_long = ((u64::from(n) * u64::from(long)) as f64 / f64::from(short)) as u64;
                if width <= height { (new_long, u64::from(n)) } else { (u64::from(n), new_long) }
            }
        };
        if rh > MAX_SIDE || rw > MAX_SIDE {
            return Err(MediaError::ExtremeAspectRatio { width, height, resized_width: rw, resized_height: rh });
        }
        Ok((rh, rw))
    }

    /// Whether an image of this size can be preprocessed (see [`Self::resized_size`]).
    pub fn check_size(&self, width: u32, height: u32) -> Result<(), MediaError> {
        self.resized_size(width, height).map(|_| ())
    }

    /// The `[3, height, width]` CHW pixel values (flattened) that transformers
    /// computes for this image (`pixel_values[0]`).
    pub fn preprocess(&self, img: &RgbImage) -> Result<Vec<f32>, MediaError> {
        let (in_w, in_h) = img.dimensions();
        let (rh, rw) = self.resized_size(in_w, in_h)?;
        let (ch, cw) = self.crop.unwrap_or((rh as u32, rw as u32));
        let (top, left) = (crop_offset(rh, ch), crop_offset(rw, cw));
        // The part of the crop that lies inside the resized image.
        let clamp = |off: i64, len: u32, full: u64| off.max(0) as u32..(off + i64::from(len)).min(full as i64) as u32;
        let (rows, cols) = (clamp(top, ch, rh), clamp(left, cw, rw));
        let window = resize_bicubic_window(img, rw as u32, rh as u32, cols.clone(), rows.clone());

        // Per channel, the f32 value of each u8 level (padding is level 0).
        let lut = level_table((self.rescale, self.normalize));
        let (ch, cw) = (ch as usize, cw as usize);
        let mut out: Vec<f32> = Vec::with_capacity(3 * ch * cw);
        for table in &lut {
            out.resize(out.len() + ch * cw, table[0]);
        }
        let (y0, x0) = ((i64::from(rows.start) - top) as usize, (i64::from(cols.start) - left) as usize);
        let win_w = window.width() as usize;
        for (y, line) in window.as_raw().chunks_exact(win_w.max(1) * 3).enumerate() {
            for (c, table) in lut.iter().enumerate() {
                let dst = &mut out[(c * ch + y0 + y) * cw + x0..][..win_w];
                for (o, px) in dst.iter_mut().zip(line.chunks_exact(3)) {
                    *o = table[usize::from(px[c])];
                }
            }
        }
        Ok(out)
    }
}
