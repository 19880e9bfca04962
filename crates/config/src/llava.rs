//! LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer MLP
//! projector and a Llama language model.

use serde_json::Value;

use crate::defaults::{Fields, checkpoint_dtype};

/// `LlamaConfig` fields the language model reads.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// `default`, `mrope` (Qwen-VL's multimodal RoPE), or a scaled RoPE (not supported yet).
    pub rope_type: String,
    /// `mrope`: how many of the head's rotary frequencies follow the temporal, height and
    /// width positions (empty otherwise).
    pub mrope_section: Vec<usize>,
    pub max_position_embeddings: usize,
    pub hidden_act: String,
    /// Bias on the q, k and v projections.
    pub attention_bias: bool,
    /// Bias on the output projection (Llama: as `attention_bias`; Qwen2: never).
    pub o_proj_bias: bool,
    pub mlp_bias: bool,
    pub tie_word_embeddings: bool,
}

/// The defaults of one decoder family's config class, for fields a config leaves out.
struct TextDefaults {
    vocab_size: usize,
    intermediate_size: usize,
    rms_norm_eps: f64,
    max_position_embeddings: usize,
}

const LLAMA: TextDefaults =
    TextDefaults { vocab_size: 32000, intermediate_size: 11008, rms_norm_eps: 1e-6, max_position_embeddings: 2048 };
const QWEN2: TextDefaults =
    TextDefaults { vocab_size: 151936, intermediate_size: 22016, rms_norm_eps: 1e-6, max_position_embeddings: 32768 };

impl LlamaConfig {
    /// Parses a Llama config object; missing fields take `LlamaConfig`'s defaults.
    pub fn from_json(v: &Value, tie_default: bool) -> Result<Self, String> {
        let mut c = Self::parse(v, tie_default, &LLAMA)?;
        c.attention_bias = Fields::new(v, "text_config").bool_or("attention_bias", false)?;
        c.o_proj_bias = c.attention_bias;
        Ok(c)
    }

    /// Parses a `Qwen2Config` (`Qwen2ForCausalLM`: the Llama decoder with biases on q, k
    /// and v, none on o); missing fields take `Qwen2Config`'s defaults.
    pub fn qwen2_from_json(v: &Value, tie_default: bool) -> Result<Self, String> {
        let f = Fields::new(v, "text_config");
        if f.bool_or("use_sliding_window", false)? {
            return Err("text_config.use_sliding_window is not supported".into());
        }
        let mut c = Self::parse(v, tie_default, &QWEN2)?;
        c.attention_bias = true;
        c.o_proj_bias = false;
        Ok(c)
    }

    fn parse(v: &Value, tie_default: bool, d: &TextDefaults) -> Result<Self, String> {
        let f = Fields::new(v, "text_config");
        let hidden_size = f.usize_or("hidden_size", 4096)?;
        let num_attention_heads = f.usize_or("num_attention_heads", 32)?;
        if num_attention_heads == 0 || !hidden_size.is_multiple_of(num_attention_heads) {
            return Err(format!(
                "text_config.hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads}"
            ));
        }
        let num_key_value_heads = f.usize_or("num_key_value_heads", num_attention_heads)?;
        if num_key_value_heads == 0 || !num_attention_heads.is_multiple_of(num_key_value_heads) {
            return Err(format!(
                "text_config.num_attention_heads {num_attention_heads} is not a multiple of num_key_value_heads {num_key_value_heads}"
            ));
        }
        // transformers v5 moves rope settings into `rope_parameters`.
        let rope = v.get("rope_parameters").filter(|r| r.is_object());
        let rope_scaling = v.get("rope_scaling").filter(|r| r.is_object());
        let rope_theta = match rope.and_then(|r| r.get("rope_theta")).and_then(Value::as_f64) {
            Some(t) => t,
            None => f.f64_or("rope_theta", 10000.0)?,
        };
        let rope_type = rope
            .or(rope_scaling)
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string();
        let mrope_section = match rope.or(rope_scaling).and_then(|r| r.get("mrope_section")) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_u64().map(|n| n as usize).ok_or("rope_scaling.mrope_section: not counts"))
                .collect::<Result<Vec<_>, _>>()?,
            _ => Vec::new(),
        };
        Ok(LlamaConfig {
            vocab_size: f.usize_or("vocab_size", d.vocab_size)?,
            hidden_size,
            intermediate_size: f.usize_or("intermediate_size", d.intermediate_size)?,
            num_hidden_layers: f.usize_or("num_hidden_layers", 32)?,
            num_attention_heads,
            num_key_value_heads,
            head_dim: f.usize_or("head_dim", hidden_size / num_attention_heads)?,
            rms_norm_eps: f.f64_or("rms_norm_eps", d.rms_norm_eps)?,
            rope_theta,
            rope_type,
            mrope_section,
            max_position_embeddings: f.usize_or("max_position_embeddings", d.max_position_embeddings)?,
            hidden_act: f.str_or("hidden_act", "silu")?,
            attention_bias: false,
            o_proj_bias: false,
            mlp_bias: f.bool_or("mlp_bias", false)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", tie_default)?,
        })
    }
}

/// `CLIPVisionConfig` fields the vision tower reads.
#[derive(Debug, Clone, PartialEq)]
pub struct ClipVisionConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_channels: usize,
    pub image_size: usize,
    pub patch_size: usize,
    pub layer_norm_eps: f64,
    pub hidden_act: String,
}

impl ClipVisionConfig {
    pub fn from_json(v: &Value) -> Result<Self, String> {
        let f = Fields::new(v, "vision_config");
        let c = ClipVisionConfig {
            hidden_size: f.usize_or("hidden_size", 768)?,
            intermediate_size: f.usize_or("intermediate_size", 3072)?,
            num_hidden_layers: f.usize_or("num_hidden_layers", 12)?,
            num_attention_heads: f.usize_or("num_attention_heads", 12)?,
            num_channels: f.usize_or("num_channels", 3)?,
            image_size: f.usize_or("image_size", 224)?,
            patch_size: f.usize_or("patch_size", 32)?,
            layer_norm_eps: f.f64_or("layer_norm_eps", 1e-5)?,
            hidden_act: f.str_or("hidden_act", "quick_gelu")?,
        };
        if c.patch_size == 0 || !c.image_size.is_multiple_of(c.patch_size) {
            return Err(format!(
                "vision_config.image_size {} is not a multiple of patch_size {}",
                c.image_size, c.patch_size
            ));
        }
        if c.num_attention_heads == 0 || !c.hidden_size.is_multiple_of(c.num_attention_heads) {
            return Err("vision_config.hidden_size is not a multiple of num_attention_heads".into());
        }
        Ok(c)
    }

    /// Patches per image side.
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size
    }
}

/// `vision_feature_select_strategy`: `default` drops the CLS row, `full` keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureSelect {
    Default,
    Full,
}

/// `LlavaConfig`.
#[derive(Debug, Clone, PartialEq)]
pub struct LlavaConfig {
    pub text: LlamaConfig,
    pub vision: ClipVisionConfig,
    pub image_token_index: u32,
    /// HF counts the embedding output as hidden state 0, so -2 is the output of the
    /// second-to-last encoder layer.
    pub vision_feature_layer: i64,
    pub vision_feature_select_strategy: FeatureSelect,
    pub projector_hidden_act: String,
    pub multimodal_projector_bias: bool,
    /// Checkpoint dtype: `dtype` (v5) or `torch_dtype` (Hub).
    pub dtype: String,
}

impl LlavaConfig {
    pub fn from_json(v: &Value) -> Result<Self, String> {
        let f = Fields::new(v, "config");
        let tie = f.bool_or("tie_word_embeddings", false)?;
        let text_json = v.get("text_config").cloned().unwrap_or(Value::Object(Default::default()));
        let vision_json = v.get("vision_config").cloned().unwrap_or(Value::Object(Default::default()));
        let mut text = LlamaConfig::from_json(&text_json, tie)?;
        // Hub configs of llava-1.5 keep the padded vocab size at the top level only sometimes.
        if text_json.get("vocab_size").is_none()
            && let Some(n) = f.opt_usize("vocab_size")?
        {
            text.vocab_size = n;
        }
        let vision = ClipVisionConfig::from_json(&vision_json)?;
        let vision_feature_layer = match f.get("vision_feature_layer") {
            None => -2,
            Some(Value::Number(n)) => {
                n.as_i64().ok_or_else(|| format!("config.vision_feature_layer must be an integer, got {n}"))?
            }
            Some(other) => {
                return Err(format!("config.vision_feature_layer {other} is not supported (a single layer index is)"));
            }
        };
        let layers = vision.num_hidden_layers as i64;
        let resolved = if vision_feature_layer < 0 { layers + 1 + vision_feature_layer } else { vision_feature_layer };
        if !(0..=layers).contains(&resolved) {
            return Err(format!(
                "config.vision_feature_layer {vision_feature_layer} is outside the {} hidden states of the vision tower",
                layers + 1
            ));
        }
        let vision_feature_select_strategy = match f.str_or("vision_feature_select_strategy", "default")?.as_str() {
            "default" => FeatureSelect::Default,
            "full" => FeatureSelect::Full,
            other => return Err(format!("config.vision_feature_select_strategy {other:?} is not default or full")),
        };
        let dtype = checkpoint_dtype(&f, &text_json)?;
        // Hub configs say `image_token_index`; some newer ones `image_token_id`.
        let image_token_index = match f.get("image_token_index") {
            Some(_) => f.usize_or("image_token_index", 32000)?,
            None => f.usize_or("image_token_id", 32000)?,
        };
        Ok(LlavaConfig {
            text,
            vision,
            image_token_index: u32::try_from(image_token_index).map_err(|_| "config.image_token_index is too large")?,
            vision_feature_layer,
            vision_feature_select_strategy,
            projector_hidden_act: f.str_or("projector_hidden_act", "gelu")?,
            multimodal_projector_bias: f.bool_or("multimodal_projector_bias", true)?,
            dtype,
        })
    }

    /// Index into the vision tower's hidden states (0 = embedding output).
    pub fn feature_hidden_state_index(&self) -> usize {
        let layers = self.vision.num_hidden_layers as i64;
        if self.vision_feature_layer < 0 {
            (layers + 1 + self.vision_feature_layer) as usize
        } else {
            self.vision_feature_layer as usize
        }
    }

    /// Embedding rows one image becomes: patches², plus CLS under `full`.
    pub fn image_token_count(&self) -> usize {
        let p = self.vision.patches_per_side();
        match self.vision_feature_select_strategy {
            FeatureSelect::Default => p * p,
            FeatureSelect::Full => p * p + 1,
        }
    }
}
