//! Qwen2-Audio (`Qwen2AudioForConditionalGeneration`, Chu et al. 2024, "Qwen2-Audio
//! Technical Report"): a Whisper-style audio encoder with average pooling, a linear
//! projector and a Qwen2 language model.

use serde_json::Value;

use crate::LlamaConfig;
use crate::defaults::{Fields, checkpoint_dtype};

/// `Qwen2AudioEncoderConfig` fields the audio tower reads.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioEncoderConfig {
    pub num_mel_bins: usize,
    pub encoder_layers: usize,
    pub encoder_attention_heads: usize,
    pub encoder_ffn_dim: usize,
    pub d_model: usize,
    /// Positions after the stride-2 convolution: 1500 for 30 s of 10 ms frames.
    pub max_source_positions: usize,
    pub activation_function: String,
    pub scale_embedding: bool,
}

impl AudioEncoderConfig {
    pub fn from_json(v: &Value) -> Result<Self, String> {
        let f = Fields::new(v, "audio_config");
        let c = AudioEncoderConfig {
            num_mel_bins: f.usize_or("num_mel_bins", 128)?,
            encoder_layers: f.usize_or("encoder_layers", 32)?,
            encoder_attention_heads: f.usize_or("encoder_attention_heads", 20)?,
            encoder_ffn_dim: f.usize_or("encoder_ffn_dim", 5120)?,
            d_model: f.usize_or("d_model", 1280)?,
            max_source_positions: f.usize_or("max_source_positions", 1500)?,
            activation_function: f.str_or("activation_function", "gelu")?,
            scale_embedding: f.bool_or("scale_embedding", false)?,
        };
        if c.encoder_attention_heads == 0 || !c.d_model.is_multiple_of(c.encoder_attention_heads) {
            return Err("audio_config.d_model is not a multiple of encoder_attention_heads".into());
        }
        if c.max_source_positions == 0 {
            return Err("audio_config.max_source_positions must be positive".into());
        }
        Ok(c)
    }

    /// Mel frames the encoder takes (the feature extractor pads every clip to this).
    pub fn max_mel_frames(&self) -> usize {
        self.max_source_positions * 2
    }
}

/// Embedding rows (`<|AUDIO|>` tokens) of a clip with `valid_frames` mel frames: the
/// stride-2 convolution, then the stride-2 average pooling, as transformers'
/// `_get_feat_extract_output_lengths` counts them: `((L − 1) // 2 + 1 − 2) // 2 + 1`
/// with Python's floor division, or 0 when that is not positive. 3000 frames (30 s)
/// give 750.
pub fn audio_token_count(valid_frames: usize) -> usize {
    let l = valid_frames as i64;
    let tokens = ((l - 1).div_euclid(2) + 1 - 2).div_euclid(2) + 1;
    tokens.max(0) as usize
}

/// `Qwen2AudioConfig`.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2AudioConfig {
    pub text: LlamaConfig,
    pub audio: AudioEncoderConfig,
    pub audio_token_index: u32,
    /// Checkpoint dtype: `dtype` (v5) or `torch_dtype` (Hub).
    pub dtype: String,
}

impl Qwen2AudioConfig {
    pub fn from_json(v: &Value) -> Result<Self, String> {
        let f = Fields::new(v, "config");
        let tie = f.bool_or("tie_word_embeddings", false)?;
        let empty = Value::Object(Default::default());
        let text_json = v.get("text_config").unwrap_or(&empty);
        let mut text = LlamaConfig::qwen2_from_json(text_json, tie)?;
        if text_json.get("vocab_size").is_none()
            && let Some(n) = f.opt_usize("vocab_size")?
        {
            text.vocab_size = n;
        }
        let audio = AudioEncoderConfig::from_json(v.get("audio_config").unwrap_or(&empty))?;
        let audio_token_index = match f.get("audio_token_index") {
            Some(_) => f.usize_or("audio_token_index", 151646)?,
            None => f.usize_or("audio_token_id", 151646)?,
        };
        Ok(Qwen2AudioConfig {
            text,
            audio,
            audio_token_index: u32::try_from(audio_token_index).map_err(|_| "config.audio_token_index is too large")?,
            dtype: checkpoint_dtype(&f, text_json)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_count_matches_transformers() {
        // The fixture: 137 valid frames → 34 tokens; 30 s → 750.
        assert_eq!(audio_token_count(137), 34);
        assert_eq!(audio_token_count(3000), 750);
        // Python: ((1 - 1)//2 + 1 - 2)//2 + 1 = (-1)//2 + 1 = 0.
        assert_eq!(audio_token_count(0), 0);
        assert_eq!(audio_token_count(1), 0);
        assert_eq!(audio_token_count(2), 0);
        assert_eq!(audio_token_count(3), 1);
        assert_eq!(audio_token_count(6), 1);
        assert_eq!(audio_token_count(7), 2);
    }

    #[test]
    fn hub_config_with_qwen2_defaults() {
        let v: Value = serde_json::json!({
            "architectures": ["Qwen2AudioForConditionalGeneration"],
            "model_type": "qwen2_audio",
            "audio_config": {"model_type": "qwen2_audio_encoder"},
            "text_config": {"model_type": "qwen2", "vocab_size": 156032},
            "audio_token_index": 151646,
            "torch_dtype": "bfloat16"
        });
        let c = Qwen2AudioConfig::from_json(&v).unwrap();
        assert_eq!((c.audio.d_model, c.audio.encoder_layers, c.audio.num_mel_bins), (1280, 32, 128));
        assert_eq!(c.text.vocab_size, 156032);
        assert_eq!(c.text.intermediate_size, 22016);
        assert!(c.text.attention_bias && !c.text.o_proj_bias);
        assert_eq!(c.dtype, "bfloat16");
        assert_eq!(c.audio.max_mel_frames(), 3000);
    }
}
