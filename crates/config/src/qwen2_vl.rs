//! Qwen2-VL's vision tower (`Qwen2VisionTransformerPretrainedModel`, Wang et al. 2024,
//! "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any
//! Resolution"): the `vision_config` fields it reads. Both config layouts name them the
//! same.

use serde_json::Value;

use crate::defaults::Fields;

/// `Qwen2VLVisionConfig` fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2VisionConfig {
    pub depth: usize,
    pub embed_dim: usize,
    pub mlp_ratio: usize,
    pub num_heads: usize,
    pub in_chans: usize,
    /// Width of the merger's output: the language model's hidden size.
    pub hidden_size: usize,
    pub patch_size: usize,
    pub spatial_merge_size: usize,
    pub temporal_patch_size: usize,
    pub hidden_act: String,
}

impl Qwen2VisionConfig {
    /// From a `config.json` value (its `vision_config`).
    pub fn from_json(config: &Value) -> Result<Self, String> {
        let v = config.get("vision_config").ok_or("config.json has no vision_config")?;
        let f = Fields::new(v, "vision_config");
        let c = Qwen2VisionConfig {
            depth: f.usize_or("depth", 32)?,
            embed_dim: f.usize_or("embed_dim", 1280)?,
            mlp_ratio: f.usize_or("mlp_ratio", 4)?,
            num_heads: f.usize_or("num_heads", 16)?,
            in_chans: f.usize_or("in_chans", 3)?,
            hidden_size: f.usize_or("hidden_size", 3584)?,
            patch_size: f.usize_or("patch_size", 14)?,
            spatial_merge_size: f.usize_or("spatial_merge_size", 2)?,
            temporal_patch_size: f.usize_or("temporal_patch_size", 2)?,
            hidden_act: f.str_or("hidden_act", "quick_gelu")?,
        };
        if c.num_heads == 0 || !c.embed_dim.is_multiple_of(c.num_heads) {
            return Err("vision_config.embed_dim is not a multiple of num_heads".into());
        }
        if !(c.embed_dim / c.num_heads).is_multiple_of(4) {
            return Err("vision_config: the head dim must be a multiple of 4 (2-D rotary halves)".into());
        }
        if c.spatial_merge_size == 0 || c.patch_size == 0 || c.temporal_patch_size == 0 {
            return Err("vision_config: patch, merge and temporal patch sizes must be positive".into());
        }
        Ok(c)
    }

    /// Values of one patch as the preprocessor lays it out: channels × frames × p².
    pub fn patch_values(&self) -> usize {
        self.in_chans * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixtures_vision_config_parses_with_defaults() {
        let v: Value =
            serde_json::json!({"vision_config": {"depth": 2, "embed_dim": 32, "num_heads": 4, "hidden_size": 64}});
        let c = Qwen2VisionConfig::from_json(&v).unwrap();
        assert_eq!((c.depth, c.embed_dim, c.hidden_size, c.mlp_ratio), (2, 32, 64, 4));
        assert_eq!(c.hidden_act, "quick_gelu");
        assert_eq!(c.patch_values(), 3 * 2 * 14 * 14);
        let bad = serde_json::json!({"vision_config": {"embed_dim": 30, "num_heads": 4}});
        assert!(Qwen2VisionConfig::from_json(&bad).is_err());
    }
}
