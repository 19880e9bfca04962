//! transformers' `Qwen2VLImageProcessor` (PIL backend; Qwen2-VL and Qwen2.5-VL use the
//! same one) from `preprocessor_config.json`: `smart_resize` to multiples of
//! `patch_size × merge_size` within `[min_pixels, max_pixels]`, PIL bicubic, rescale,
//! normalise, then the flattened patches `[grid_h · grid_w, 3 · temporal · patch²]` in
//! transformers' order (2×2 merge blocks row by row; each row `[channel, temporal, y, x]`,
//! the temporal copies identical).

use image::RgbImage;
use serde_json::{Map, Value};

use crate::{
    MediaError,
    clip::{Levels, bad, check_resample, field, flag, level_table, levels_fingerprint, parse_levels},
    resample::resize_bicubic,
};

/// transformers' defaults: `56 × 56` and `28 × 28 × 1280` pixels.
const DEFAULT_MIN_PIXELS: u64 = 56 * 56;
const DEFAULT_MAX_PIXELS: u64 = 28 * 28 * 1280;
/// `smart_resize` refuses images whose longer side exceeds 200 times the shorter.
pub const MAX_ASPECT_RATIO: u32 = 200;

/// A `Qwen2VLImageProcessor`'s settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2VlImageProcessor {
    min_pixels: u64,
    max_pixels: u64,
    patch_size: u32,
    temporal_patch_size: u32,
    merge_size: u32,
    resize: bool,
    levels: Levels,
    convert_rgb: bool,
}

/// The processor's output for one image.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2VlPixels {
    /// `[grid_t · grid_h · grid_w, 3 · temporal_patch_size · patch_size²]`, row-major.
    pub pixel_values: Vec<f32>,
    /// `(1, resized height / patch, resized width / patch)`: transformers' `image_grid_thw`.
    pub grid_thw: [u32; 3],
}

impl Qwen2VlPixels {
    /// Rows of `pixel_values` (patches).
    pub fn num_patches(&self) -> usize {
        self.grid_thw.iter().map(|&n| n as usize).product()
    }

    /// Columns of `pixel_values`.
    pub fn patch_dim(&self) -> usize {
        self.pixel_values.len() / self.num_patches().max(1)
    }
}

fn positive(cfg: &Map<String, Value>, key: &str, default: u64) -> Result<u64, MediaError> {
    match field(cfg, key) {
        None => Ok(default),
        Some(v) => v.as_u64().filter(|&n| n > 0).ok_or_else(|| bad(format!("`{key}` must be a positive integer"))),
    }
}

/// Python's `round(a / b)` (halves to even) for positive integers, as transformers computes
/// it: in f64.
fn round_div(a: u64, b: u64) -> u64 {
    (a as f64 / b as f64).round_ties_even() as u64
}

/// transformers' `smart_resize(height, width, factor, min_pixels, max_pixels)`: the
/// `(height, width)` an image is resized to. Both are multiples of `factor`: the nearest
/// ones (halves to even), then scaled by a square root to bring the area within
/// `[min_pixels, max_pixels]` (rounding down when shrinking, up when growing). The
/// arithmetic is Python's in f64 (exact while `height · width < 2^53`).
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32), MediaError> {
    if height == 0 || width == 0 {
        return Err(MediaError::ZeroSized);
    }
    let (h, w, f) = (u64::from(height), u64::from(width), u64::from(factor.max(1)));
    if h.max(w) as f64 / h.min(w) as f64 > f64::from(MAX_ASPECT_RATIO) {
        return Err(MediaError::AspectRatio { width, height, max_ratio: MAX_ASPECT_RATIO });
    }
    let (mut hb, mut wb) = (round_div(h, f) * f, round_div(w, f) * f);
    if hb.saturating_mul(wb) > max_pixels {
        let beta = ((h * w) as f64 / max_pixels as f64).sqrt();
        hb = f.max((h as f64 / beta / f as f64).floor() as u64 * f);
        wb = f.max((w as f64 / beta / f as f64).floor() as u64 * f);
    } else if hb * wb < min_pixels {
        let beta = (min_pixels as f64 / (h * w) as f64).sqrt();
        hb = (h as f64 * beta / f as f64).ceil() as u64 * f;
        wb = (w as f64 * beta / f as f64).ceil() as u64 * f;
    }
    let side = |v: u64| u32::try_from(v).map_err(|_| bad(format!("smart_resize of {width}x{height} overflows")));
    Ok((side(hb)?, side(wb)?))
}

impl Qwen2VlImageProcessor {
    /// Reads a `preprocessor_config.json` (`image_processor_type` `Qwen2VLImageProcessor`,
    /// also with the `Fast` / `Pil` suffix; Qwen2.5-VL's configs name the same class).
    /// The pixel bounds come, as in transformers 5.x, from `min_pixels` / `max_pixels`
    /// when present, else from `size: {shortest_edge, longest_edge}`, else the defaults
    /// `56·56` and `28·28·1280`; a `size` without both bounds is refused, as transformers
    /// refuses it when preprocessing.
    pub fn from_json(cfg: &Value) -> Result<Self, MediaError> {
        let cfg = cfg.as_object().ok_or_else(|| bad("the config must be a JSON object"))?;
        if let Some(t) = field(cfg, "image_processor_type") {
            let t = t.as_str().unwrap_or_default();
            if !t.starts_with("Qwen2VLImageProcessor") {
                return Err(bad(format!("image processor type {t:?} is not Qwen2VLImageProcessor")));
            }
        }
        check_resample(cfg)?;
        let (mut min_pixels, mut max_pixels) = (Some(DEFAULT_MIN_PIXELS), Some(DEFAULT_MAX_PIXELS));
        if let Some(size) = field(cfg, "size") {
            let size = size.as_object().ok_or_else(|| bad(format!("unsupported `size`: {size}")))?;
            let bound =
                |k| field(size, k).map(|v| v.as_u64().ok_or_else(|| bad(format!("`size.{k}` must be an integer"))));
            min_pixels = bound("shortest_edge").transpose()?;
            max_pixels = bound("longest_edge").transpose()?;
        }
        let top = |k| field(cfg, k).map(|v| v.as_u64().ok_or_else(|| bad(format!("`{k}` must be an integer"))));
        min_pixels = top("min_pixels").transpose()?.or(min_pixels);
        max_pixels = top("max_pixels").transpose()?.or(max_pixels);
        let (Some(min_pixels), Some(max_pixels)) = (min_pixels.filter(|&n| n > 0), max_pixels.filter(|&n| n > 0))
        else {
            return Err(bad(
                "the pixel bounds must be given and positive: `min_pixels` and `max_pixels`, or `size` with `shortest_edge` and `longest_edge`",
            ));
        };
        let small = |key, default| {
            positive(cfg, key, default)?
                .try_into()
                .ok()
                .filter(|&n: &u32| n <= 1 << 12)
                .ok_or_else(|| bad(format!("`{key}` is too large")))
        };
        let patch_size = small("patch_size", 14)?;
        let temporal_patch_size = small("temporal_patch_size", 2)?;
        let merge_size = small("merge_size", 2)?;
        if patch_size * merge_size > 1 << 12 {
            return Err(bad("`patch_size` × `merge_size` is too large"));
        }
        Ok(Self {
            min_pixels,
            max_pixels,
            patch_size,
            temporal_patch_size,
            merge_size,
            resize: flag(cfg, "do_resize")?,
            levels: parse_levels(cfg)?,
            convert_rgb: flag(cfg, "do_convert_rgb")?,
        })
    }

    /// `patch_size × merge_size` (28 for Qwen2-VL): resized sides are multiples of it.
    pub fn factor(&self) -> u32 {
        self.patch_size * self.merge_size
    }

    pub fn patch_size(&self) -> u32 {
        self.patch_size
    }

    pub fn merge_size(&self) -> u32 {
        self.merge_size
    }

    pub fn temporal_patch_size(&self) -> u32 {
        self.temporal_patch_size
    }

    /// `(min_pixels, max_pixels)`.
    pub fn pixel_bounds(&self) -> (u64, u64) {
        (self.min_pixels, self.max_pixels)
    }

    /// This processor with other pixel bounds (a request's `mm_processor_kwargs`); both
    /// must be positive, the smaller first.
    pub fn with_pixel_bounds(&self, min_pixels: u64, max_pixels: u64) -> Result<Self, MediaError> {
        if min_pixels == 0 || min_pixels > max_pixels {
            return Err(bad(format!(
                "min_pixels ({min_pixels}) must be positive and at most max_pixels ({max_pixels})"
            )));
        }
        Ok(Self { min_pixels, max_pixels, ..self.clone() })
    }

    /// The `(height, width)` an image of `height × width` pixels is resized to (see
    /// [`smart_resize`]); without `do_resize` the size itself, which must then be a
    /// multiple of [`Self::factor`].
    pub fn smart_resize(&self, height: u32, width: u32) -> Result<(u32, u32), MediaError> {
        if !self.resize {
            let f = self.factor();
            if height == 0 || width == 0 {
                return Err(MediaError::ZeroSized);
            }
            if !height.is_multiple_of(f) || !width.is_multiple_of(f) {
                return Err(bad(format!("without `do_resize`, image sides must be multiples of {f}")));
            }
            return Ok((height, width));
        }
        smart_resize(height, width, self.factor(), self.min_pixels, self.max_pixels)
    }

    /// transformers' `image_grid_thw` for an image of `height × width` pixels.
    pub fn grid_thw(&self, height: u32, width: u32) -> Result<[u32; 3], MediaError> {
        let (h, w) = self.smart_resize(height, width)?;
        Ok([1, h / self.patch_size, w / self.patch_size])
    }

    /// The number of image tokens (`<|image_pad|>`) for an image of `height × width`
    /// pixels: `(H / factor) · (W / factor)` after [`Self::smart_resize`].
    pub fn num_tokens(&self, height: u32, width: u32) -> Result<usize, MediaError> {
        let (h, w) = self.smart_resize(height, width)?;
        Ok((h / self.factor()) as usize * (w / self.factor()) as usize)
    }

    /// A canonical description of every setting that affects the output (for cache keys),
    /// with a version tag of the algorithm.
    pub fn fingerprint(&self) -> String {
        format!(
            "qwen2vl-pil-v1;convert_rgb={};resize={};min_pixels={};max_pixels={};patch={};temporal={};merge={};resample=bicubic;{}",
            self.convert_rgb,
            self.resize,
            self.min_pixels,
            self.max_pixels,
            self.patch_size,
            self.temporal_patch_size,
            self.merge_size,
            levels_fingerprint(self.levels)
        )
    }

    /// transformers' `pixel_values` and `image_grid_thw` for this image.
    pub fn preprocess(&self, img: &RgbImage) -> Result<Qwen2VlPixels, MediaError> {
        let (w, h) = img.dimensions();
        let (rh, rw) = self.smart_resize(h, w)?;
        let resized;
        let img = if (rw, rh) == (w, h) {
            img
        } else {
            resized = resize_bicubic(img, rw, rh);
            &resized
        };
        let lut = level_table(self.levels);
        let (p, t, m) = (self.patch_size as usize, self.temporal_patch_size as usize, self.merge_size as usize);
        let (gh, gw) = (rh as usize / p, rw as usize / p);
        let dim = 3 * t * p * p;
        let mut out = vec![0f32; gh * gw * dim];
        let raw = img.as_raw();
        let mut rows = out.chunks_exact_mut(dim);
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let row = rows.next().expect("gh · gw rows");
                        let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        for (c, per_channel) in row.chunks_exact_mut(t * p * p).enumerate() {
                            let (first, copies) = per_channel.split_at_mut(p * p);
                            for (py, line) in first.chunks_exact_mut(p).enumerate() {
                                let start = ((y0 + py) * rw as usize + x0) * 3;
                                for (v, px) in line.iter_mut().zip(raw[start..start + 3 * p].chunks_exact(3)) {
                                    *v = lut[c][usize::from(px[c])];
                                }
                            }
                            for copy in copies.chunks_exact_mut(p * p) {
                                copy.copy_from_slice(first);
                            }
                        }
                    }
                }
            }
        }
        Ok(Qwen2VlPixels { pixel_values: out, grid_thw: [1, gh as u32, gw as u32] })
    }
}
