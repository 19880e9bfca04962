//! The encoder's model, by modality: what turns an item's bytes from the data arena
//! into the tower's input, and a batch of inputs into embedding rows. A new modality
//! plugs in here (its preprocessing and its tower) and nowhere else in the encoder.

use candle_core::{Device, Tensor};
use mmserve_config::{ModelConfig, ModelDir};
use mmserve_media::audio::WhisperFeatureExtractor;
use mmserve_media::{ClipImageProcessor, ImageLimits, Qwen2VlImageProcessor, decode_image};
use mmserve_models::{Grid, LlavaVision, Placement, Qwen2AudioEncoder, Qwen2VisionTower};

use crate::EncoderServiceError;

pub(crate) enum Tower {
    /// LLaVA: CLIP pixels → vision tower and projector.
    Vision { model: LlavaVision, device: Device },
    /// Qwen2-Audio: log-mel features → audio tower, pooling and projector.
    Audio { model: Qwen2AudioEncoder, features: WhisperFeatureExtractor, device: Device },
    /// Qwen2-VL / Qwen2.5-VL: each image's patches at its own size → the tower and merger,
    /// the batch as one packed sequence.
    QwenVl { model: Box<Qwen2VisionTower>, patch_values: usize, merge: usize, device: Device },
}

/// What turns an item's bytes into its tower input, on the CPU: shared by the threads
/// that preprocess items while the tower runs.
pub(crate) enum Preparer {
    /// LLaVA: the image file → CLIP pixels.
    Vision { processor: ClipImageProcessor, limits: ImageLimits },
    /// Qwen2-Audio: 16 kHz mono samples (decoded by the api) → log-mel features.
    Audio { features: WhisperFeatureExtractor },
    /// Qwen-VL: the image file → patches at its dynamic resolution.
    QwenVl { processor: Qwen2VlImageProcessor, limits: ImageLimits },
}

/// One item's tower input.
pub(crate) struct Input {
    values: Vec<f32>,
    /// Audio: mel frames that hold the clip (the rest is padding).
    valid_frames: usize,
    /// Qwen-VL: the image's patch grid.
    grid: Option<Grid>,
}

impl Tower {
    /// The tower and its preprocessing.
    pub(crate) fn load(dir: &ModelDir, placement: &Placement) -> Result<(Self, Preparer), EncoderServiceError> {
        let pp = dir.optional_json("preprocessor_config.json")?.ok_or(EncoderServiceError::NoPreprocessor)?;
        match &dir.config {
            ModelConfig::Llava(_) => {
                let processor = ClipImageProcessor::from_json(&pp)?;
                let model = LlavaVision::load(dir, placement)?;
                let (h, w) = processor.output_size();
                if h != model.image_size() || w != model.image_size() {
                    return Err(EncoderServiceError::SizeMismatch { got: h.max(w), want: model.image_size() });
                }
                let tower = Tower::Vision { model, device: placement.device.clone() };
                Ok((tower, Preparer::Vision { processor, limits: ImageLimits::default() }))
            }
            ModelConfig::Qwen2Audio(cfg) => {
                let features = WhisperFeatureExtractor::from_json(&pp)?;
                let frames = cfg.audio.max_mel_frames();
                if features.feature_size != cfg.audio.num_mel_bins || features.nb_max_frames != frames {
                    return Err(EncoderServiceError::Mismatch(format!(
                        "the feature extractor makes {}×{} features; the audio tower takes {}×{frames}",
                        features.feature_size, features.nb_max_frames, cfg.audio.num_mel_bins
                    )));
                }
                let model = Qwen2AudioEncoder::load(dir, placement)?;
                let tower = Tower::Audio { model, features: features.clone(), device: placement.device.clone() };
                Ok((tower, Preparer::Audio { features }))
            }
            ModelConfig::Qwen2Vl(cfg) => {
                let processor = Qwen2VlImageProcessor::from_json(&pp)?;
                let model = Qwen2VisionTower::from_weights(&placement.weights(dir)?, &cfg.vision)?;
                let tower = Tower::QwenVl {
                    model: Box::new(model),
                    patch_values: cfg.vision.patch_values(),
                    merge: cfg.vision.spatial_merge_size,
                    device: placement.device.clone(),
                };
                Ok((tower, Preparer::QwenVl { processor, limits: ImageLimits::default() }))
            }
        }
    }

    pub(crate) fn device(&self) -> &Device {
        match self {
            Tower::Vision { device, .. } | Tower::Audio { device, .. } | Tower::QwenVl { device, .. } => device,
        }
    }

    /// Embedding rows of each input ([tokens, hidden] per item, on the tower's device), in order.
    pub(crate) fn run(&self, inputs: Vec<Input>) -> Result<Vec<Tensor>, String> {
        let n = inputs.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let out = match self {
            Tower::Vision { model, device } => {
                let s = model.image_size();
                let pixels: Vec<f32> = inputs.into_iter().flat_map(|i| i.values).collect();
                let input = Tensor::from_vec(pixels, (n, 3, s, s), device).map_err(|e| e.to_string())?;
                let rows = model.encode(&input).map_err(|e| e.to_string())?;
                (0..n).map(|i| rows.get(i)).collect::<candle_core::Result<Vec<_>>>()
            }
            Tower::Audio { model, features, device } => {
                let valid: Vec<usize> = inputs.iter().map(|i| i.valid_frames).collect();
                let values: Vec<f32> = inputs.into_iter().flat_map(|i| i.values).collect();
                let shape = (n, features.feature_size, features.nb_max_frames);
                let input = Tensor::from_vec(values, shape, device).map_err(|e| e.to_string())?;
                Ok(model.encode(&input, &valid).map_err(|e| e.to_string())?)
            }
            Tower::QwenVl { model, patch_values, merge, device } => {
                let grids: Vec<Grid> =
                    inputs.iter().map(|i| i.grid.ok_or("an input without its grid")).collect::<Result<_, _>>()?;
                let values: Vec<f32> = inputs.into_iter().flat_map(|i| i.values).collect();
                let rows = values.len() / *patch_values;
                let input = Tensor::from_vec(values, (rows, *patch_values), device).map_err(|e| e.to_string())?;
                let out = model.forward(&input, &grids).map_err(|e| e.to_string())?;
                let mut at = 0;
                grids
                    .iter()
                    .map(|g| {
                        let n = g.t * g.h * g.w / (merge * merge);
                        at += n;
                        out.narrow(0, at - n, n)
                    })
                    .collect::<candle_core::Result<Vec<_>>>()
            }
        };
        out.map_err(|e| e.to_string())
    }
}

impl Preparer {
    /// The tower input of an item whose data is `bytes` (Qwen-VL: resized within
    /// `bounds` when the request chose them); an error says why the item is bad.
    pub(crate) fn prepare(&self, bytes: &[u8], bounds: Option<(u64, u64)>) -> Result<Input, String> {
        if bounds.is_some() && !matches!(self, Preparer::QwenVl { .. }) {
            return Err("pixel bounds for a model whose processor takes none".into());
        }
        match self {
            Preparer::Vision { processor, limits } => {
                let img = decode_image(bytes, limits).map_err(|e| e.to_string())?;
                let values = processor.preprocess(&img).map_err(|e| e.to_string())?;
                Ok(Input { values, valid_frames: 0, grid: None })
            }
            Preparer::QwenVl { processor, limits } => {
                let img = decode_image(bytes, limits).map_err(|e| e.to_string())?;
                let p = match bounds {
                    Some((min, max)) => processor.with_pixel_bounds(min, max).and_then(|p| p.preprocess(&img)),
                    None => processor.preprocess(&img),
                }
                .map_err(|e| e.to_string())?;
                let [t, h, w] = p.grid_thw.map(|n| n as usize);
                Ok(Input { values: p.pixel_values, valid_frames: 0, grid: Some(Grid { t, h, w }) })
            }
            Preparer::Audio { features } => {
                if bytes.is_empty() || !bytes.len().is_multiple_of(4) {
                    return Err(format!("{} bytes are not 32-bit samples", bytes.len()));
                }
                let samples: Vec<f32> =
                    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
                let f = features.extract(&samples);
                Ok(Input { values: f.input_features, valid_frames: f.valid_frames, grid: None })
            }
        }
    }
}
