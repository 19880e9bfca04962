//! The image processor a model's `preprocessor_config.json` names, behind one type.

use image::RgbImage;
use serde_json::Value;

use crate::{ClipImageProcessor, MediaError, Qwen2VlImageProcessor, Qwen2VlPixels, clip::bad};

/// An image processor chosen by `image_processor_type` (or, in old configs,
/// `feature_extractor_type`): `CLIPImageProcessor*` / `CLIPFeatureExtractor` or
/// `Qwen2VLImageProcessor*` (Qwen2-VL and Qwen2.5-VL).
#[derive(Debug, Clone, PartialEq)]
pub enum ImageProcessor {
    Clip(ClipImageProcessor),
    Qwen2Vl(Qwen2VlImageProcessor),
}

/// A processor's output for one image.
#[derive(Debug, Clone, PartialEq)]
pub enum ImagePixels {
    /// `[3, height, width]` (CHW), a fixed size for every image.
    Clip { pixel_values: Vec<f32>, height: usize, width: usize },
    /// `[patches, patch_dim]` and `image_grid_thw`.
    Qwen2Vl(Qwen2VlPixels),
}

impl ImagePixels {
    pub fn pixel_values(&self) -> &[f32] {
        match self {
            Self::Clip { pixel_values, .. } | Self::Qwen2Vl(Qwen2VlPixels { pixel_values, .. }) => pixel_values,
        }
    }

    pub fn into_pixel_values(self) -> Vec<f32> {
        match self {
            Self::Clip { pixel_values, .. } | Self::Qwen2Vl(Qwen2VlPixels { pixel_values, .. }) => pixel_values,
        }
    }

    /// The shape of `pixel_values`: `[3, h, w]` or `[patches, patch_dim]`.
    pub fn shape(&self) -> Vec<usize> {
        match self {
            Self::Clip { height, width, .. } => vec![3, *height, *width],
            Self::Qwen2Vl(q) => vec![q.num_patches(), q.patch_dim()],
        }
    }
}

impl ImageProcessor {
    /// Reads a `preprocessor_config.json`, picking the processor from its type.
    pub fn from_json(cfg: &Value) -> Result<Self, MediaError> {
        let kind = |key| cfg.get(key).and_then(Value::as_str);
        match kind("image_processor_type").or(kind("feature_extractor_type")) {
            Some(t) if t.starts_with("CLIPImageProcessor") || t == "CLIPFeatureExtractor" => {
                ClipImageProcessor::from_json(cfg).map(Self::Clip)
            }
            Some(t) if t.starts_with("Qwen2VLImageProcessor") => {
                Qwen2VlImageProcessor::from_json(cfg).map(Self::Qwen2Vl)
            }
            Some(t) => Err(bad(format!(
                "image processor type {t:?} is not supported (CLIPImageProcessor, Qwen2VLImageProcessor)"
            ))),
            None => Err(bad("the config names no `image_processor_type`")),
        }
    }

    /// `(min_pixels, max_pixels)` where the processor resizes to fit them (Qwen2-VL).
    pub fn pixel_bounds(&self) -> Option<(u64, u64)> {
        match self {
            Self::Clip(_) => None,
            Self::Qwen2Vl(p) => Some(p.pixel_bounds()),
        }
    }

    /// This processor with other pixel bounds (see
    /// [`Qwen2VlImageProcessor::with_pixel_bounds`]); CLIP's fixed size has none.
    pub fn with_pixel_bounds(&self, min_pixels: u64, max_pixels: u64) -> Result<Self, MediaError> {
        match self {
            Self::Clip(_) => {
                Err(bad("this model's image processor (CLIP) resizes to a fixed size: it takes no pixel bounds"))
            }
            Self::Qwen2Vl(p) => p.with_pixel_bounds(min_pixels, max_pixels).map(Self::Qwen2Vl),
        }
    }

    /// See [`ClipImageProcessor::fingerprint`] and [`Qwen2VlImageProcessor::fingerprint`].
    pub fn fingerprint(&self) -> String {
        match self {
            Self::Clip(p) => p.fingerprint(),
            Self::Qwen2Vl(p) => p.fingerprint(),
        }
    }

    /// Checks from the size alone that an image of `width × height` pixels can be
    /// preprocessed, and returns its number of image tokens when the processor decides it:
    /// `Some(n)` for Qwen2-VL; `None` for CLIP, whose count is fixed by the model (vision
    /// config and `num_additional_image_tokens`), whatever the image.
    pub fn num_tokens(&self, width: u32, height: u32) -> Result<Option<usize>, MediaError> {
        match self {
            Self::Clip(p) => p.check_size(width, height).map(|()| None),
            Self::Qwen2Vl(p) => p.num_tokens(height, width).map(Some),
        }
    }

    /// The grid of merged patches (rows, columns) an image of `width × height` pixels
    /// becomes, where the processor decides it (Qwen2-VL); `None` for CLIP.
    pub fn merged_grid(&self, width: u32, height: u32) -> Result<Option<(usize, usize)>, MediaError> {
        match self {
            Self::Clip(_) => Ok(None),
            Self::Qwen2Vl(p) => {
                let (h, w) = p.smart_resize(height, width)?;
                Ok(Some(((h / p.factor()) as usize, (w / p.factor()) as usize)))
            }
        }
    }

    /// transformers' `pixel_values` (and `image_grid_thw`) for this image.
    pub fn preprocess(&self, img: &RgbImage) -> Result<ImagePixels, MediaError> {
        match self {
            Self::Clip(p) => {
                let (height, width) = p.output_size();
                Ok(ImagePixels::Clip { pixel_values: p.preprocess(img)?, height, width })
            }
            Self::Qwen2Vl(p) => p.preprocess(img).map(ImagePixels::Qwen2Vl),
        }
    }
}
