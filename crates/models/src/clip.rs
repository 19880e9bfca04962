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

use crate::layer_norm::LayerNorm;
use candle_core::{Module, Tensor};

use crate::linear::Linear;
use mmserve_config::ClipVisionConfig;

use crate::ModelError;
use crate::activation::Activation;
use crate::encoder_attention::{Flavor, SelfAttention};
use crate::patch_embed::PatchEmbed;
use crate::weights::{Scope, Weights};

struct EncoderLayer {
    layer_norm1: LayerNorm,
    self_attn: SelfAttention,
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
            self_attn: SelfAttention::load(
                &s.pp("self_attn"),
                d,
                cfg.num_attention_heads,
                Flavor { k_bias: true, scale_queries: false },
            )?,
            layer_norm2: s.layer_norm("layer_norm2", d, eps)?,
            fc1: s.linear("mlp.fc1", d, cfg.intermediate_size, true)?,
            fc2: s.linear("mlp.fc2", cfg.intermediate_size, d, true)?,
            act: Activation::from_name(&cfg.hidden_act)?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // out_proj with its bias only, and the residual add inside layer_norm2: transformers'
        // rounding order (the projection rounded, then the sum). The residual in out_proj's
        // GEMM epilogue instead measured the same within noise (H100, CLIP-L at 32 images:
        // 24.48-24.49 ms against 24.53-24.72).
        let a = self.self_attn.forward(&self.layer_norm1.forward(x)?, None, None)?;
        let (x, normed) = self.layer_norm2.add_forward(x, &a)?;
        let h = self.fc1.forward_act(&normed, self.act)?;
        self.fc2.forward_residual(&h, &x)
    }
}

/// The CLIP vision transformer, with its first `num_layers` encoder layers loaded.
pub struct ClipVisionTower {
    patch_embedding: Tensor,
    /// On the GPU: the same conv as unfold + GEMM (`patch_embed.rs`).
    patch_gemm: Option<PatchEmbed>,
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
        let patch_embedding = emb.tensor("patch_embedding.weight", (d, cfg.num_channels, p, p))?;
        let patch_gemm =
            patch_embedding.device().is_cuda().then(|| PatchEmbed::new(&patch_embedding, s.kernels())).transpose()?;
        Ok(ClipVisionTower {
            patch_embedding,
            patch_gemm,
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
        if let Some(gemm) = &self.patch_gemm {
            let x = gemm.forward(pixel_values, &self.class_embedding, &self.position_embedding)?;
            return Ok(self.pre_layrnorm.forward(&x)?);
        }
        let x = pixel_values.to_dtype(self.patch_embedding.dtype())?;
        let patches = x.conv2d(&self.patch_embedding, 0, cfg.patch_size, 1, 1)?.flatten_from(2)?.transpose(1, 2)?;
        let cls = self.class_embedding.reshape((1, 1, cfg.hidden_size))?.broadcast_as((b, 1, cfg.hidden_size))?;
        let x = Tensor::cat(&[&cls, &patches], 1)?.broadcast_add(&self.position_embedding)?;
        Ok(self.pre_layrnorm.forward(&x)?)
    }
}
