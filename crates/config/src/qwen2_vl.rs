//! The Qwen-VL vision towers' `vision_config`: Qwen2-VL's
//! (`Qwen2VisionTransformerPretrainedModel`, Wang et al. 2024, "Qwen2-VL: Enhancing
//! Vision-Language Model's Perception of the World at Any Resolution": `embed_dim`,
//! `mlp_ratio`, `hidden_size` as the merger's output) and Qwen2.5-VL's
//! (`Qwen2_5_VisionTransformerPretrainedModel`, Bai et al. 2025, "Qwen2.5-VL Technical
//! Report": `hidden_size` as the tower's width, `intermediate_size`, `out_hidden_size`,
//! `window_size`, `fullatt_block_indexes`). Both config layouts name them the same.

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
    /// Width of a block's MLP.
    pub mlp_hidden: usize,
    /// Qwen2.5-VL: RMSNorm, a gated (SwiGLU) MLP, and window attention.
    pub window: Option<WindowAttention>,
}

/// Qwen2.5-VL's window attention: windows of `window_size` pixels, except in the blocks
/// listed, which attend over the whole image.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowAttention {
    pub window_size: usize,
    pub fullatt_block_indexes: Vec<usize>,
}

impl Qwen2VisionConfig {
    /// From a `config.json` value (its `vision_config`).
    pub fn from_json(config: &Value) -> Result<Self, String> {
        let v = config.get("vision_config").ok_or("config.json has no vision_config")?;
        let f = Fields::new(v, "vision_config");
        let model_type = config.get("model_type").and_then(Value::as_str).unwrap_or_default();
        let v25 = model_type == "qwen2_5_vl" || f.get("out_hidden_size").is_some();
        let mut c = Qwen2VisionConfig {
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
            mlp_hidden: 0,
            window: None,
        };
        if v25 {
            c.embed_dim = f.usize_or("hidden_size", 1280)?;
            c.hidden_size = f.usize_or("out_hidden_size", 3584)?;
            c.hidden_act = f.str_or("hidden_act", "silu")?;
            c.mlp_hidden = f.usize_or("intermediate_size", 3420)?;
            let full = match f.get("fullatt_block_indexes") {
                None => vec![7, 15, 23, 31],
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|x| x.as_u64().map(|n| n as usize).ok_or("vision_config.fullatt_block_indexes: not indexes"))
                    .collect::<Result<_, _>>()?,
                Some(other) => return Err(format!("vision_config.fullatt_block_indexes must be a list, got {other}")),
            };
            c.window =
                Some(WindowAttention { window_size: f.usize_or("window_size", 112)?, fullatt_block_indexes: full });
        } else {
            c.mlp_hidden = c.embed_dim * c.mlp_ratio;
        }
        if c.num_heads == 0 || !c.embed_dim.is_multiple_of(c.num_heads) {
            return Err("vision_config.embed_dim is not a multiple of num_heads".into());
        }
        if !(c.embed_dim / c.num_heads).is_multiple_of(4) {
            return Err("vision_config: the head dim must be a multiple of 4 (2-D rotary halves)".into());
        }
        if c.spatial_merge_size == 0 || c.patch_size == 0 || c.temporal_patch_size == 0 {
            return Err("vision_config: patch, merge and temporal patch sizes must be positive".into());
        }
        if let Some(w) = &c.window
            && w.window_size / c.spatial_merge_size / c.patch_size == 0
        {
            return Err("vision_config.window_size is smaller than one merged patch".into());
        }
        Ok(c)
    }

    /// Values of one patch as the preprocessor lays it out: channels × frames × p².
    pub fn patch_values(&self) -> usize {
        self.in_chans * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

/// `Qwen2VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration`: the vision
/// tower, a Qwen2 language model with M-RoPE, and the image placeholder's id.
#[derive(Debug, Clone)]
pub struct Qwen2VlConfig {
    pub text: crate::LlamaConfig,
    pub vision: Qwen2VisionConfig,
    /// `<|image_pad|>`: the chat template writes one per image; the api expands it.
    pub image_token_id: u32,
    pub dtype: String,
}

impl Qwen2VlConfig {
    /// The Hub's flat layout (text fields at the top) or v5's (`text_config`).
    pub fn from_json(v: &Value) -> Result<Self, String> {
        let text_json = v.get("text_config").filter(|t| t.is_object()).unwrap_or(v);
        let text = crate::LlamaConfig::qwen2_from_json(text_json, false)?;
        if text.rope_type != "mrope" || text.mrope_section.len() != 3 {
            return Err("a Qwen-VL config needs rope_scaling {type: mrope, mrope_section: [t, h, w]}".into());
        }
        let top = Fields::new(v, "config");
        let image_token_id = match top.get("image_token_id").or_else(|| text_json.get("image_token_id")) {
            Some(x) => x.as_u64().ok_or("config.image_token_id must be an id")? as u32,
            None => 151655,
        };
        let dtype = crate::defaults::checkpoint_dtype(&top, text_json)?;
        Ok(Qwen2VlConfig { text, vision: Qwen2VisionConfig::from_json(v)?, image_token_id, dtype })
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
        let v25 = serde_json::json!({"model_type": "qwen2_5_vl", "vision_config": {"depth": 2, "hidden_size": 32,
            "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 64, "window_size": 56, "fullatt_block_indexes": [1]}});
        let c = Qwen2VisionConfig::from_json(&v25).unwrap();
        assert_eq!((c.embed_dim, c.hidden_size, c.mlp_hidden, c.hidden_act.as_str()), (32, 64, 64, "silu"));
        assert_eq!(c.window, Some(WindowAttention { window_size: 56, fullatt_block_indexes: vec![1] }));
    }

    /// The real 7B configurations under `assets/` (for `--load-format dummy` runs) parse
    /// into their published shapes.
    #[test]
    fn the_7b_configs_in_assets_parse() {
        let read = |d: &str| -> Value {
            let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../assets/models")
                .join(d)
                .join("config.json");
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
        };
        let v2 = Qwen2VisionConfig::from_json(&read("qwen2-vl-7b-instruct")).unwrap();
        assert_eq!((v2.depth, v2.embed_dim, v2.num_heads, v2.hidden_size, v2.mlp_hidden), (32, 1280, 16, 3584, 5120));
        assert!(v2.window.is_none());
        let v25 = Qwen2VisionConfig::from_json(&read("qwen2.5-vl-7b-instruct")).unwrap();
        assert_eq!((v25.embed_dim, v25.hidden_size, v25.mlp_hidden), (1280, 3584, 3420));
        assert_eq!(v25.window.unwrap().fullatt_block_indexes, [7, 15, 23, 31]);
        let text = crate::LlamaConfig::qwen2_from_json(&read("qwen2.5-vl-7b-instruct"), false).unwrap();
        assert_eq!((text.num_key_value_heads, text.head_dim, text.mrope_section.clone()), (4, 128, vec![16, 24, 24]));
    }
}
