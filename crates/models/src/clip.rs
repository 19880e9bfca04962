//! The CLIP vision transformer (Radford et al. 2021, "Learning Transferable Visual
//! Models From Natural Language Supervision"), as transformers' `CLIPVisionModel`
//! (`CLIPVisionTransformer` without its pooled output) runs it for LLaVA.
//!
//! Reads `CLIPVisionConfig`: `hidden_size`, `intermediate_size`, `num_hidden_layers`,
//! `num_attention_heads`, `num_channels`, `image_size`, `patch_size`, `layer_norm_eps`,
//! `hidden_act`.
//!
//! Hidden states are numbered as transformers numbers them: 0 is the embedding output
//! after `pre_layrnorm`, `i` is the output of encoder layer `i - 1`. `post_layernorm`
//! only feeds the pooled output, which LLaVA does not use, so it is never loaded.

use candle_core::{DType, Module, Tensor};
use candle_nn::{LayerNorm, Linear};
use mmserve_config::ClipVisionConfig;

use crate::ModelError;
use crate::activation::Activation;
use crate::weights::{Scope, Weights};

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    num_heads: usize,
    scale: f64,
}

impl Attention {
    fn load(s: &Scope, cfg: &ClipVisionConfig) -> Result<Self, ModelError> {
        let d = cfg.hidden_size;
        Ok(Attention {
            q_proj: s.linear("q_proj", d, d, true)?,
            k_proj: s.linear("k_proj", d, d, true)?,
            v_proj: s.linear("v_proj", d, d, true)?,
            out_proj: s.linear("out_proj", d, d, true)?,
            num_heads: cfg.num_attention_heads,
            scale: ((d / cfg.num_attention_heads) as f64).powf(-0.5),
        })
    }

    /// Full (unmasked) attention over `x` [B, N, D].
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, n, d) = x.dims3()?;
        let heads = |proj: &Linear| {
            proj.forward(x)?.reshape((b, n, self.num_heads, d / self.num_heads))?.transpose(1, 2)?.contiguous()
        };
        let (q, k, v) = (heads(&self.q_proj)?, heads(&self.k_proj)?, heads(&self.v_proj)?);
        let scores = (q.matmul(&k.t()?)? * self.scale)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?;
        let out = probs.to_dtype(v.dtype())?.matmul(&v)?;
        let out = out.transpose(1, 2)?.reshape((b, n, d))?;
        self.out_proj.forward(&out)
    }
}

struct EncoderLayer {
    layer_norm1: LayerNorm,
    self_attn: Attention,
    layer_norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    act: Activation,
}

impl EncoderLayer {
    fn load(s: &Scope, cfg: &ClipVisionConfig) -> Result<Self, ModelError> {
        let (d, eps) = (cfg.hidden_size, cfg.layer_norm_eps);
        Ok(EncoderLayer {
            layer_norm1: s.layer_norm("layer_norm1", d, eps)?,
            self_attn: Attention::load(&s.pp("self_attn"), cfg)?,
            layer_norm2: s.layer_norm("layer_norm2", d, eps)?,
            fc1: s.linear("mlp.fc1", d, cfg.intermediate_size, true)?,
            fc2: s.linear("mlp.fc2", cfg.intermediate_size, d, true)?,
            act: Activation::from_name(&cfg.hidden_act)?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.self_attn.forward(&self.layer_norm1.forward(x)?)?;
        let x = (x + h)?;
        let h = self.fc1.forward(&self.layer_norm2.forward(&x)?)?;
        let h = self.fc2.forward(&self.act.apply(&h)?)?;
        x + h
    }
}

/// The CLIP vision transformer, with its first `num_layers` encoder layers loaded.
pub struct ClipVisionTower {
    patch_embedding: Tensor,
    class_embedding: Tensor,
    position_embedding: Tensor,
    pre_layrnorm: LayerNorm,
    layers: Vec<EncoderLayer>,
    cfg: ClipVisionConfig,
}

impl ClipVisionTower {
    /// Loads the embeddings, `pre_layrnorm` and encoder layers `0..num_layers`
    /// (at most `cfg.num_hidden_layers`): enough to produce hidden states `0..=num_layers`.
    pub fn load(weights: &Weights, cfg: &ClipVisionConfig, num_layers: usize) -> Result<Self, ModelError> {
        if num_layers > cfg.num_hidden_layers {
            return Err(ModelError::InvalidInput(format!(
                "asked for {num_layers} CLIP layers, the config has {}",
                cfg.num_hidden_layers
            )));
        }
        let s = weights.vision_model();
        let (d, p) = (cfg.hidden_size, cfg.patch_size);
        let positions = cfg.patches_per_side() * cfg.patches_per_side() + 1;
        let emb = s.pp("embeddings");
        let layers = (0..num_layers)
            .map(|i| EncoderLayer::load(&s.pp("encoder.layers").pp(i), cfg))
            .collect::<Result<_, _>>()?;
        Ok(ClipVisionTower {
            patch_embedding: emb.tensor("patch_embedding.weight", (d, cfg.num_channels, p, p))?,
            class_embedding: emb.tensor("class_embedding", d)?,
            position_embedding: emb.tensor("position_embedding.weight", (positions, d))?,
            pre_layrnorm: s.layer_norm("pre_layrnorm", d, cfg.layer_norm_eps)?,
            layers,
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &ClipVisionConfig {
        &self.cfg
    }

    /// Encoder layers loaded; hidden states `0..=num_layers()` can be computed.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Hidden state `index` for `pixel_values` [B, C, S, S] (any float dtype): [B, 1 +
    /// patches, hidden], CLS row first. Runs only the first `index` encoder layers.
    pub fn hidden_state(&self, pixel_values: &Tensor, index: usize) -> Result<Tensor, ModelError> {
        self.run(pixel_values, index, None)
    }

    /// Hidden states `0..=last`, as transformers' `output_hidden_states` returns them.
    pub fn hidden_states(&self, pixel_values: &Tensor, last: usize) -> Result<Vec<Tensor>, ModelError> {
        let mut states = Vec::with_capacity(last + 1);
        let final_state = self.run(pixel_values, last, Some(&mut states))?;
        states.push(final_state);
        Ok(states)
    }

    /// Hidden state `last`; the earlier ones go to `earlier` if given.
    fn run(
        &self,
        pixel_values: &Tensor,
        last: usize,
        mut earlier: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor, ModelError> {
        if last > self.layers.len() {
            return Err(ModelError::InvalidInput(format!(
                "hidden state {last} needs {last} CLIP layers, {} are loaded",
                self.layers.len()
            )));
        }
        let mut x = self.embed(pixel_values)?;
        for layer in &self.layers[..last] {
            let next = layer.forward(&x)?;
            if let Some(states) = earlier.as_deref_mut() {
                states.push(x);
            }
            x = next;
        }
        Ok(x)
    }

    /// Patch + class + position embeddings, then `pre_layrnorm`: hidden state 0.
    fn embed(&self, pixel_values: &Tensor) -> Result<Tensor, ModelError> {
        let (b, c, h, w) = pixel_values.dims4()?;
        let (cfg, size) = (&self.cfg, self.cfg.image_size);
        if c != cfg.num_channels || h != size || w != size {
            return Err(ModelError::InvalidInput(format!(
                "pixel_values [{b}, {c}, {h}, {w}]: expected [B, {}, {size}, {size}]",
                cfg.num_channels
            )));
        }
        let x = pixel_values.to_dtype(self.patch_embedding.dtype())?;
        let patches = x.conv2d(&self.patch_embedding, 0, cfg.patch_size, 1, 1)?.flatten_from(2)?.transpose(1, 2)?;
        let cls = self.class_embedding.reshape((1, 1, cfg.hidden_size))?.broadcast_as((b, 1, cfg.hidden_size))?;
        let x = Tensor::cat(&[&cls, &patches], 1)?.broadcast_add(&self.position_embedding)?;
        Ok(self.pre_layrnorm.forward(&x)?)
    }
}
