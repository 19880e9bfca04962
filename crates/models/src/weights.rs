//! Checkpoint access for `LlavaForConditionalGeneration` (LLaVA-1.5, Liu et al. 2023,
//! "Improved Baselines with Visual Instruction Tuning").
//!
//! Reads the safetensors files that `ModelDir::weight_files` names (one file or the
//! shards of `model.safetensors.index.json`), memory-mapped, and converts tensors to the
//! requested dtype as they are loaded. Two tensor naming schemes exist and are told
//! apart by which names the checkpoint holds:
//!
//! | part | Hub (transformers < 4.52 layout) | transformers v5 |
//! |---|---|---|
//! | language model | `language_model.model.*` | `model.language_model.*` |
//! | LM head | `language_model.lm_head.weight` | `lm_head.weight` |
//! | vision tower | `vision_tower.vision_model.*` | `model.vision_tower.vision_model.*` |
//! | (CLIP tower as transformers 5.24 saves a new model) | `vision_tower.*` | `model.vision_tower.*` |
//! | (Qwen2-Audio's LM as transformers 5.17 saves a new model) | `language_model.model.model.*` | |
//! | projector | `multi_modal_projector.*` | `model.multi_modal_projector.*` |
//! | audio tower (Qwen2-Audio) | `audio_tower.*` | `model.audio_tower.*` |
//!
//! Reads no config fields itself; `dtype` (config `dtype` / `torch_dtype`) can be mapped
//! with [`parse_dtype`].

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::{RmsNorm, VarBuilder};
use mmserve_config::WeightFiles;
use mmserve_ops::Kernels;

use crate::ModelError;
use crate::layer_norm::LayerNorm;
use crate::linear::Linear;

/// Which tensor naming scheme a checkpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// `language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`.
    Hub,
    /// `model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`,
    /// `lm_head.weight`.
    V5,
    /// Qwen-VL on the Hub: `model.*` (the language model), `visual.*`, `lm_head.weight`.
    Flat,
}

impl Naming {
    fn language_model(self) -> &'static str {
        match self {
            Naming::Hub => "language_model.model",
            Naming::V5 => "model.language_model",
            Naming::Flat => "model",
        }
    }

    fn lm_head(self) -> &'static str {
        match self {
            Naming::Hub => "language_model.lm_head",
            Naming::V5 | Naming::Flat => "lm_head",
        }
    }

    fn vision_model(self) -> &'static str {
        match self {
            Naming::Hub | Naming::Flat => "vision_tower.vision_model",
            Naming::V5 => "model.vision_tower.vision_model",
        }
    }

    fn projector(self) -> &'static str {
        match self {
            Naming::Hub | Naming::Flat => "multi_modal_projector",
            Naming::V5 => "model.multi_modal_projector",
        }
    }

    fn audio_tower(self) -> &'static str {
        match self {
            Naming::Hub | Naming::Flat => "audio_tower",
            Naming::V5 => "model.audio_tower",
        }
    }

    /// Qwen-VL's vision tower.
    fn visual(self) -> &'static str {
        match self {
            Naming::Hub | Naming::Flat => "visual",
            Naming::V5 => "model.visual",
        }
    }
}

/// Maps a config dtype name (`float32`, `bfloat16`, `float16`) to a candle dtype.
pub fn parse_dtype(name: &str) -> Result<DType, ModelError> {
    match name {
        "float32" | "f32" => Ok(DType::F32),
        "bfloat16" | "bf16" => Ok(DType::BF16),
        "float16" | "f16" | "half" => Ok(DType::F16),
        other => Err(ModelError::Unsupported(format!("dtype {other:?}"))),
    }
}

/// The tensors of a checkpoint, memory-mapped, with its naming scheme detected.
pub struct Weights {
    vb: VarBuilder<'static>,
    naming: Naming,
    /// Made up on request ([`crate::LoadFormat::Dummy`]): tensors need their shape.
    dummy: bool,
    /// The kernel choices the layers made from these weights take.
    kernels: Kernels,
    /// Where the CLIP tower's `CLIPVisionTransformer` is: the naming's, or one level up
    /// (transformers 5.24 saves a newly made LLaVA's tower without `vision_model`).
    vision_prefix: &'static str,
    /// Where the language model's `embed_tokens`, `layers` and `norm` are: the naming's, or
    /// one `model.` deeper (transformers 5.17 saves a newly made Qwen2-Audio that way, and
    /// 5.24 loads it).
    lm_prefix: &'static str,
}

impl Weights {
    /// Maps the files and detects the naming scheme. Tensors are converted to `dtype`
    /// and placed on `device` when a model takes them.
    pub fn open(files: &WeightFiles, device: &Device, dtype: DType) -> Result<Self, ModelError> {
        let paths = files.paths();
        // SAFETY: the files are mapped read-only; candle copies every tensor out of the
        // mapping when it is loaded, so the mapping only has to stay valid while this
        // `Weights` lives. Like every mmap-based loader we rely on nobody truncating or
        // rewriting the checkpoint files while the server reads them.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&paths, dtype, device)? };
        let probe = |naming: Naming| {
            [
                format!("{}.embed_tokens.weight", naming.language_model()),
                format!("{}.embeddings.class_embedding", naming.vision_model()),
            ]
            .iter()
            .any(|name| vb.contains_tensor(name))
        };
        const NESTED_LM: &str = "language_model.model.model";
        let lm_prefix = vb.contains_tensor(&format!("{NESTED_LM}.embed_tokens.weight")).then_some(NESTED_LM);
        let naming = if probe(Naming::Hub) || lm_prefix.is_some() {
            Naming::Hub
        } else if probe(Naming::V5) {
            Naming::V5
        } else if probe(Naming::Flat) {
            Naming::Flat
        } else {
            return Err(ModelError::MissingTensor(format!(
                "{}.embed_tokens.weight (or {}.embed_tokens.weight)",
                Naming::Hub.language_model(),
                Naming::V5.language_model()
            )));
        };
        let vision_prefix = [naming.vision_model(), naming.vision_model().trim_end_matches(".vision_model")]
            .into_iter()
            .find(|p| vb.contains_tensor(&format!("{p}.embeddings.class_embedding")))
            .unwrap_or(naming.vision_model());
        let lm_prefix = lm_prefix.unwrap_or(naming.language_model());
        Ok(Weights { vb, naming, dummy: false, kernels: Kernels::default(), vision_prefix, lm_prefix })
    }

    pub(crate) fn from_var_builder(vb: VarBuilder<'static>, dummy: bool) -> Self {
        Weights {
            vb,
            naming: Naming::Hub,
            dummy,
            kernels: Kernels::default(),
            vision_prefix: Naming::Hub.vision_model(),
            lm_prefix: Naming::Hub.language_model(),
        }
    }

    /// The same weights, for layers that take `kernels`.
    pub fn with_kernels(self, kernels: Kernels) -> Self {
        Weights { kernels, ..self }
    }

    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    pub fn naming(&self) -> Naming {
        self.naming
    }

    pub fn dtype(&self) -> DType {
        self.vb.dtype()
    }

    pub fn device(&self) -> &Device {
        self.vb.device()
    }

    fn scope(&self, prefix: &str) -> Scope {
        Scope(self.vb.pp(prefix), self.dummy, self.kernels)
    }

    /// `LlamaModel`: embed_tokens, layers, norm.
    pub(crate) fn language_model(&self) -> Scope {
        self.scope(self.lm_prefix)
    }

    /// Where the LM head's `weight` lives (absent with tied embeddings).
    pub(crate) fn lm_head(&self) -> Scope {
        self.scope(self.naming.lm_head())
    }

    /// `CLIPVisionTransformer`: embeddings, pre_layrnorm, encoder.
    pub(crate) fn vision_model(&self) -> Scope {
        self.scope(self.vision_prefix)
    }

    /// `LlavaMultiModalProjector` (linear_1, linear_2) or Qwen2-Audio's (linear).
    pub(crate) fn projector(&self) -> Scope {
        self.scope(self.naming.projector())
    }

    /// `Qwen2AudioEncoder`: conv1, conv2, embed_positions, layers, layer_norm.
    pub(crate) fn audio_tower(&self) -> Scope {
        self.scope(self.naming.audio_tower())
    }

    /// Qwen-VL's vision tower: patch_embed, blocks, merger.
    pub(crate) fn visual(&self) -> Scope {
        self.scope(self.naming.visual())
    }
}

/// A name prefix within a checkpoint, with shape-checked loaders.
#[derive(Clone)]
pub(crate) struct Scope(VarBuilder<'static>, bool, Kernels);

impl Scope {
    pub(crate) fn pp(&self, name: impl ToString) -> Scope {
        Scope(self.0.pp(name), self.1, self.2)
    }

    pub(crate) fn kernels(&self) -> Kernels {
        self.2
    }

    pub(crate) fn device(&self) -> &Device {
        self.0.device()
    }

    pub(crate) fn contains(&self, name: &str) -> bool {
        self.0.contains_tensor(name)
    }

    fn full_name(&self, name: &str) -> String {
        match self.0.prefix() {
            p if p.is_empty() => name.to_string(),
            p => format!("{p}.{name}"),
        }
    }

    /// The tensor `name`, which must have exactly `shape`.
    pub(crate) fn tensor(&self, name: &str, shape: impl Into<Shape>) -> Result<Tensor, ModelError> {
        if !self.contains(name) {
            return Err(ModelError::MissingTensor(self.full_name(name)));
        }
        let shape = shape.into();
        if self.1 {
            return Ok(self.0.get(shape, name)?);
        }
        let t = self.0.get_unchecked(name)?;
        if t.shape() != &shape {
            return Err(ModelError::ShapeMismatch {
                name: self.full_name(name),
                expected: shape.dims().to_vec(),
                found: t.dims().to_vec(),
            });
        }
        Ok(t)
    }

    /// A `nn.Linear(in_dim, out_dim, bias)` stored as `{name}.weight` [out, in] and
    /// `{name}.bias` [out].
    pub(crate) fn linear(&self, name: &str, in_dim: usize, out_dim: usize, bias: bool) -> Result<Linear, ModelError> {
        let s = self.pp(name);
        let weight = s.tensor("weight", (out_dim, in_dim))?;
        let bias = if bias { Some(s.tensor("bias", out_dim)?) } else { None };
        Ok(Linear::new(weight, bias, self.2))
    }

    /// An `nn.LayerNorm(dim)` with weight and bias.
    pub(crate) fn layer_norm(&self, name: &str, dim: usize, eps: f64) -> Result<LayerNorm, ModelError> {
        let s = self.pp(name);
        Ok(LayerNorm::new(s.tensor("weight", dim)?, s.tensor("bias", dim)?, eps))
    }

    /// A Llama RMSNorm (weight only).
    pub(crate) fn rms_norm(&self, name: &str, dim: usize, eps: f64) -> Result<RmsNorm, ModelError> {
        Ok(RmsNorm::new(self.pp(name).tensor("weight", dim)?, eps))
    }
}
