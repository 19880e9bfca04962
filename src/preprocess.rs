//! `mmserve preprocess --model DIR FILE --out OUT.safetensors`: exactly what the encoder
//! would receive for one image or audio file, under transformers' names and shapes
//! (`pixel_values` [+ `image_grid_thw`], or `input_features` + `feature_attention_mask`),
//! plus `num_tokens`. Reads only the model directory's config and preprocessor files.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use mmserve_media::audio::{AudioLimits, Features, WhisperFeatureExtractor, decode_audio, qwen2_audio_tokens};
use mmserve_media::{ImageLimits, ImagePixels, ImageProcessor, decode_image};
use safetensors::{Dtype, tensor::TensorView};
use serde_json::Value;

#[derive(Debug, clap::Args)]
pub struct PreprocessArgs {
    /// Hugging Face model directory (config.json and preprocessor_config.json are read).
    #[arg(long, env = "MMSERVE_MODEL")]
    pub model: PathBuf,
    /// An image or audio file.
    pub file: PathBuf,
    /// Where to write the tensors.
    #[arg(long)]
    pub out: PathBuf,
}

/// The processor a preprocessor config names.
pub enum Preprocessor {
    Image(ImageProcessor),
    Audio(WhisperFeatureExtractor),
}

impl Preprocessor {
    pub fn from_json(cfg: &Value) -> anyhow::Result<Self> {
        if cfg.get("feature_extractor_type").and_then(Value::as_str) == Some("WhisperFeatureExtractor") {
            return Ok(Self::Audio(WhisperFeatureExtractor::from_json(cfg)?));
        }
        Ok(Self::Image(ImageProcessor::from_json(cfg)?))
    }

    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::from_json(&serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?)
    }
}

/// Named tensors, owned, ready for safetensors.
pub struct Tensors(Vec<(String, Dtype, Vec<usize>, Vec<u8>)>);

impl Tensors {
    fn f32(&mut self, name: &str, shape: Vec<usize>, v: &[f32]) {
        self.0.push((name.into(), Dtype::F32, shape, v.iter().flat_map(|x| x.to_le_bytes()).collect()));
    }

    fn i64(&mut self, name: &str, shape: Vec<usize>, v: &[i64]) {
        self.0.push((name.into(), Dtype::I64, shape, v.iter().flat_map(|x| x.to_le_bytes()).collect()));
    }

    fn write(&self, out: &Path) -> anyhow::Result<()> {
        let views: Vec<(String, TensorView<'_>)> = self
            .0
            .iter()
            .map(|(n, d, s, b)| Ok((n.clone(), TensorView::new(*d, s.clone(), b)?)))
            .collect::<Result<_, safetensors::SafeTensorError>>()?;
        safetensors::serialize_to_file(views, None, out)?;
        Ok(())
    }
}

/// What the encoder computes from one item's bytes (decoded and preprocessed), with the
/// token count: the work `bench preprocess` times.
pub enum Prepared {
    Image { pixels: ImagePixels, tokens: usize },
    Audio { features: Features },
}

/// The encoder's input for `bytes`.
pub fn prepare(pre: &Preprocessor, model_config: Option<&Value>, bytes: &[u8]) -> anyhow::Result<Prepared> {
    Ok(match pre {
        Preprocessor::Image(p) => {
            let img = decode_image(bytes, &ImageLimits::default())?;
            let pixels = p.preprocess(&img)?;
            let tokens = match &pixels {
                ImagePixels::Clip { .. } => clip_tokens(model_config)?,
                ImagePixels::Qwen2Vl(_) => p.num_tokens(img.width(), img.height())?.unwrap_or(0),
            };
            Prepared::Image { pixels, tokens }
        }
        Preprocessor::Audio(fe) => {
            let wave = decode_audio(bytes, None, &AudioLimits::default())?;
            Prepared::Audio { features: fe.extract(&wave.samples) }
        }
    })
}

/// [`prepare`]'s result under transformers' names and shapes.
pub fn run_one(pre: &Preprocessor, model_config: Option<&Value>, bytes: &[u8]) -> anyhow::Result<Tensors> {
    let mut t = Tensors(Vec::new());
    match prepare(pre, model_config, bytes)? {
        Prepared::Image { pixels, tokens } => {
            match &pixels {
                ImagePixels::Clip { pixel_values, height, width } => {
                    t.f32("pixel_values", vec![1, 3, *height, *width], pixel_values);
                }
                ImagePixels::Qwen2Vl(q) => {
                    t.f32("pixel_values", pixels.shape(), &q.pixel_values);
                    let g = q.grid_thw.map(i64::from);
                    t.i64("image_grid_thw", vec![1, 3], &g);
                }
            }
            t.i64("num_tokens", vec![1], &[tokens as i64]);
        }
        Prepared::Audio { features: f } => {
            t.f32("input_features", vec![1, f.n_mels, f.n_frames], &f.input_features);
            let mask: Vec<i64> = f.attention_mask.iter().map(|&m| i64::from(m)).collect();
            t.i64("feature_attention_mask", vec![1, f.n_frames], &mask);
            t.i64("num_tokens", vec![1], &[qwen2_audio_tokens(f.valid_frames) as i64]);
        }
    }
    Ok(t)
}

/// CLIP's token count is the model's, not the processor's.
fn clip_tokens(model_config: Option<&Value>) -> anyhow::Result<usize> {
    let Some(cfg) = model_config else { bail!("config.json is needed for the token count of a CLIP model") };
    match mmserve_config::ModelConfig::from_json(cfg).map_err(anyhow::Error::msg)? {
        mmserve_config::ModelConfig::Llava(c) => Ok(c.image_token_count()),
        other => bail!("a CLIP image processor with a {:?} model", other.media()),
    }
}

pub fn run(args: PreprocessArgs) -> anyhow::Result<()> {
    let pre = Preprocessor::load(&args.model.join("preprocessor_config.json"))?;
    let config: Option<Value> = match std::fs::read_to_string(args.model.join("config.json")) {
        Ok(text) => Some(serde_json::from_str(&text).context("parsing config.json")?),
        Err(_) => None,
    };
    let bytes = std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let tensors = run_one(&pre, config.as_ref(), &bytes)?;
    tensors.write(&args.out)?;
    for (name, dtype, shape, _) in &tensors.0 {
        println!("{name}: {dtype:?} {shape:?}");
    }
    Ok(())
}
