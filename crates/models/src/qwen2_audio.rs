//! The audio path of Qwen2-Audio (Chu et al. 2024, "Qwen2-Audio Technical Report"), as
//! transformers' `Qwen2AudioForConditionalGeneration.get_audio_features` runs it: the
//! `Qwen2AudioEncoder` (Whisper's encoder, Radford et al. 2022: two convolutions with
//! GELU, learned positions, pre-norm transformer layers) whose self-attention masks the
//! keys of padded frames, a stride-2 average pooling, the final layer norm, then the
//! `Qwen2AudioMultiModalProjector` (one linear layer).
//!
//! Reads `Qwen2AudioConfig`: `audio_config.{num_mel_bins, d_model, encoder_layers,
//! encoder_attention_heads, encoder_ffn_dim, max_source_positions,
//! activation_function}`, `text_config.hidden_size`.
//!
//! Without the key mask the valid rows move (the fixture shows differences up to 5):
//! clips are padded to 30 s, and every row would attend to the padding.

use crate::layer_norm::LayerNorm;
use candle_core::{Device, Module, Tensor};

use crate::linear::Linear;
use mmserve_config::{AudioEncoderConfig, ModelConfig, ModelDir, Qwen2AudioConfig, audio_token_count};

use crate::ModelError;
use crate::activation::Activation;
use crate::encoder_attention::{Flavor, SelfAttention};
use crate::load::Placement;
use crate::weights::{Scope, Weights};

/// The Qwen2-Audio config of a model directory.
pub(crate) fn qwen2_audio_config(dir: &ModelDir) -> Result<&Qwen2AudioConfig, ModelError> {
    match &dir.config {
        ModelConfig::Qwen2Audio(cfg) => Ok(cfg),
        _ => Err(ModelError::Unsupported("not a Qwen2AudioForConditionalGeneration checkpoint".into())),
    }
}

/// A `Conv1d` with bias: weight [out, in, k].
struct Conv1d {
    weight: Tensor,
    bias: Tensor,
    stride: usize,
}

impl Conv1d {
    fn load(s: &Scope, name: &str, (c_in, c_out): (usize, usize), stride: usize) -> Result<Self, ModelError> {
        let s = s.pp(name);
        Ok(Conv1d { weight: s.tensor("weight", (c_out, c_in, 3))?, bias: s.tensor("bias", c_out)?, stride })
    }

    /// [B, C_in, L] → [B, C_out, L / stride] (kernel 3, padding 1).
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.conv1d(&self.weight, 1, self.stride, 1, 1)?;
        y.broadcast_add(&self.bias.reshape((1, (), 1))?)
    }
}

struct EncoderLayer {
    self_attn_layer_norm: LayerNorm,
    self_attn: SelfAttention,
    final_layer_norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    act: Activation,
}

impl EncoderLayer {
    fn load(s: &Scope, cfg: &AudioEncoderConfig) -> Result<Self, ModelError> {
        let (d, ffn) = (cfg.d_model, cfg.encoder_ffn_dim);
        Ok(EncoderLayer {
            self_attn_layer_norm: s.layer_norm("self_attn_layer_norm", d, 1e-5)?,
            // Whisper's key projection has no bias; it scales the queries.
            self_attn: SelfAttention::load(
                &s.pp("self_attn"),
                d,
                cfg.encoder_attention_heads,
                Flavor { k_bias: false, scale_queries: true },
            )?,
            final_layer_norm: s.layer_norm("final_layer_norm", d, 1e-5)?,
            fc1: s.linear("fc1", d, ffn, true)?,
            fc2: s.linear("fc2", ffn, d, true)?,
            act: Activation::from_name(&cfg.activation_function)?,
        })
    }

    fn forward(&self, x: &Tensor, key_mask: &Tensor) -> candle_core::Result<Tensor> {
        let a = self.self_attn.forward(&self.self_attn_layer_norm.forward(x)?, Some(key_mask), None)?;
        let (h, normed) = self.final_layer_norm.add_forward(x, &a)?;
        self.fc2.forward_residual(&self.fc1.forward_act(&normed, self.act)?, &h)
    }
}

/// Audio tower + pooling + projector: log-mel features in, LM embedding rows out.
pub struct Qwen2AudioEncoder {
    conv1: Conv1d,
    conv2: Conv1d,
    /// [max_source_positions, d_model].
    embed_positions: Tensor,
    layers: Vec<EncoderLayer>,
    layer_norm: LayerNorm,
    projector: Linear,
    cfg: AudioEncoderConfig,
}

/// What [`Qwen2AudioEncoder::forward`] returns.
pub struct AudioFeatures {
    /// The output of each encoder layer, [B, max_source_positions, d_model].
    pub layer_outputs: Vec<Tensor>,
    /// The projector's output for every pooled position, [B, max_source_positions / 2, hidden].
    pub projected: Tensor,
}

impl Qwen2AudioEncoder {
    pub fn load(dir: &ModelDir, placement: &Placement) -> Result<Self, ModelError> {
        let weights = placement.weights(dir)?;
        Self::from_weights(&weights, qwen2_audio_config(dir)?)
    }

    pub fn from_weights(weights: &Weights, cfg: &Qwen2AudioConfig) -> Result<Self, ModelError> {
        let a = &cfg.audio;
        let s = weights.audio_tower();
        let d = a.d_model;
        let layers = (0..a.encoder_layers)
            .map(|i| EncoderLayer::load(&s.pp("layers").pp(i), a))
            .collect::<Result<_, ModelError>>()?;
        Ok(Qwen2AudioEncoder {
            conv1: Conv1d::load(&s, "conv1", (a.num_mel_bins, d), 1)?,
            conv2: Conv1d::load(&s, "conv2", (d, d), 2)?,
            embed_positions: s.tensor("embed_positions.weight", (a.max_source_positions, d))?,
            layers,
            layer_norm: s.layer_norm("layer_norm", d, 1e-5)?,
            projector: weights.projector().linear("linear", d, cfg.text.hidden_size, true)?,
            cfg: a.clone(),
        })
    }

    pub fn config(&self) -> &AudioEncoderConfig {
        &self.cfg
    }

    /// Embedding rows of each clip: `features` [B, num_mel_bins, 2 · max_source_positions]
    /// (f32, padded as `WhisperFeatureExtractor` pads), `valid_frames[b]` mel frames of
    /// clip `b` are real. Returns, per clip, [`audio_token_count`] rows of [hidden].
    pub fn encode(&self, features: &Tensor, valid_frames: &[usize]) -> Result<Vec<Tensor>, ModelError> {
        let out = self.forward(features, valid_frames)?;
        valid_frames
            .iter()
            .enumerate()
            .map(|(b, &frames)| Ok(out.projected.get(b)?.narrow(0, 0, audio_token_count(frames))?))
            .collect()
    }

    /// The whole forward, with every layer's output (for parity tests).
    pub fn forward(&self, features: &Tensor, valid_frames: &[usize]) -> Result<AudioFeatures, ModelError> {
        let (b, mels, frames) = features.dims3()?;
        let positions = self.cfg.max_source_positions;
        if mels != self.cfg.num_mel_bins || frames != 2 * positions || valid_frames.len() != b {
            return Err(ModelError::InvalidInput(format!(
                "audio features {:?} for {} clips: expected [clips, {}, {}]",
                features.dims(),
                valid_frames.len(),
                self.cfg.num_mel_bins,
                2 * positions
            )));
        }
        if let Some(&bad) = valid_frames.iter().find(|&&f| f == 0 || f > frames) {
            return Err(ModelError::InvalidInput(format!("{bad} valid mel frames of {frames}")));
        }
        let dtype = self.embed_positions.dtype();
        let x = features.to_dtype(dtype)?;
        let x = self.conv1.forward(&x)?.gelu_erf()?;
        let x = self.conv2.forward(&x)?.gelu_erf()?.transpose(1, 2)?;
        let mut h = x.broadcast_add(&self.embed_positions)?;
        let key_mask = key_mask(valid_frames, positions, features.device())?;
        let mut layer_outputs = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            h = layer.forward(&h, &key_mask)?;
            layer_outputs.push(h.clone());
        }
        // AvgPool1d(2, stride 2) over time.
        let d = self.cfg.d_model;
        let pooled = h.reshape((b, positions / 2, 2, d))?.mean(2)?;
        let projected = self.projector.forward(&self.layer_norm.forward(&pooled)?)?;
        Ok(AudioFeatures { layer_outputs, projected })
    }
}

/// [B, 1, 1, positions]: 0 where a key is within the clip's frames after the stride-2
/// convolution, -inf past them.
fn key_mask(valid_frames: &[usize], positions: usize, device: &Device) -> Result<Tensor, ModelError> {
    let mut mask = Vec::with_capacity(valid_frames.len() * positions);
    for &frames in valid_frames {
        let valid = (frames - 1) / 2 + 1;
        mask.extend((0..positions).map(|p| if p < valid { 0f32 } else { f32::NEG_INFINITY }));
    }
    Ok(Tensor::from_vec(mask, (valid_frames.len(), 1, 1, positions), device)?)
}
