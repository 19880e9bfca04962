//! The image path of LLaVA-1.5 (Liu et al. 2023, "Improved Baselines with Visual
//! Instruction Tuning"), as transformers' `LlavaForConditionalGeneration.get_image_features`
//! runs it: CLIP hidden state `vision_feature_layer`, feature selection, then
//! `LlavaMultiModalProjector` (linear_1, activation, linear_2). Also the merge of image
//! features into the text embeddings at the `<image>` token positions.
//!
//! Reads `LlavaConfig`: `vision_config`, `vision_feature_layer` (through
//! `feature_hidden_state_index`), `vision_feature_select_strategy`,
//! `projector_hidden_act`, `multimodal_projector_bias`, `text_config.hidden_size`.

use crate::linear::Linear;
use candle_core::{Module, Tensor};
use mmserve_config::{FeatureSelect, LlavaConfig, ModelConfig, ModelDir};

use crate::ModelError;
use crate::activation::Activation;
use crate::clip::ClipVisionTower;
use crate::llama::Llama;
use crate::load::Placement;
use crate::weights::Weights;

/// The LLaVA config of a model directory.
pub(crate) fn llava_config(dir: &ModelDir) -> Result<&LlavaConfig, ModelError> {
    match &dir.config {
        ModelConfig::Llava(cfg) => Ok(cfg),
        #[allow(unreachable_patterns)]
        _ => Err(ModelError::Unsupported("not a LlavaForConditionalGeneration checkpoint".into())),
    }
}

/// Vision tower + feature selection + projector: pixels in, LM embedding rows out.
pub struct LlavaVision {
    tower: ClipVisionTower,
    feature_index: usize,
    select: FeatureSelect,
    linear_1: Linear,
    act: Activation,
    linear_2: Linear,
    tokens_per_image: usize,
}

impl LlavaVision {
    pub fn load(dir: &ModelDir, placement: &Placement) -> Result<Self, ModelError> {
        let weights = placement.weights(dir)?;
        Self::from_weights(&weights, llava_config(dir)?)
    }

    /// Loads only the CLIP layers that the selected hidden state needs.
    pub fn from_weights(weights: &Weights, cfg: &LlavaConfig) -> Result<Self, ModelError> {
        let feature_index = cfg.feature_hidden_state_index();
        let tower = ClipVisionTower::load(weights, &cfg.vision, feature_index)?;
        let proj = weights.projector();
        let (v, t, bias) = (cfg.vision.hidden_size, cfg.text.hidden_size, cfg.multimodal_projector_bias);
        Ok(LlavaVision {
            tower,
            feature_index,
            select: cfg.vision_feature_select_strategy,
            linear_1: proj.linear("linear_1", v, t, bias)?,
            act: Activation::from_name(&cfg.projector_hidden_act)?,
            linear_2: proj.linear("linear_2", t, t, bias)?,
            tokens_per_image: cfg.image_token_count(),
        })
    }

    /// `pixel_values` [B, 3, S, S] (f32, already normalized) → [B, tokens_per_image,
    /// text hidden_size] in the model dtype.
    pub fn encode(&self, pixel_values: &Tensor) -> Result<Tensor, ModelError> {
        let features = self.tower.hidden_state(pixel_values, self.feature_index)?;
        let features = match self.select {
            FeatureSelect::Default => {
                let n = features.dim(1)?;
                mmserve_ops::row_copy::rows_of_each(&features, 1, n - 1)?
            }
            FeatureSelect::Full => features,
        };
        let h = self.linear_1.forward_act(&features, self.act)?;
        Ok(self.linear_2.forward(&h)?)
    }

    /// Side of the square input image in pixels (`vision_config.image_size`).
    pub fn image_size(&self) -> usize {
        self.tower.config().image_size
    }

    /// Embedding rows (`<image>` tokens) one image becomes.
    pub fn tokens_per_image(&self) -> usize {
        self.tokens_per_image
    }

    /// The vision tower, loaded up to the selected hidden state.
    pub fn tower(&self) -> &ClipVisionTower {
        &self.tower
    }
}

/// The LM input embeddings of a prompt: text rows for `ids`, except that the i-th
/// occurrence of `image_token` takes row i of `image_embeds` ([n, hidden] or
/// [images, tokens_per_image, hidden], flattened in order). Returns [ids.len(), hidden].
pub fn merge_image_embeddings(
    llama: &Llama,
    ids: &[u32],
    image_token: u32,
    image_embeds: &Tensor,
) -> Result<Tensor, ModelError> {
    let hidden = llama.config().hidden_size;
    if image_embeds.rank() < 2 || image_embeds.dims().last() != Some(&hidden) {
        return Err(ModelError::InvalidInput(format!(
            "image embeddings {:?}: expected [..., {hidden}]",
            image_embeds.dims()
        )));
    }
    let image_rows = image_embeds.reshape(((), hidden))?;
    let n_image = ids.iter().filter(|&&id| id == image_token).count();
    if n_image != image_rows.dim(0)? {
        return Err(ModelError::InvalidInput(format!(
            "{n_image} image tokens in the prompt but {} image embedding rows",
            image_rows.dim(0)?
        )));
    }
    // Image positions get a placeholder id (0) for the text lookup, then pick their row
    // from the image block appended after the text rows.
    let text_ids: Vec<u32> = ids.iter().map(|&id| if id == image_token { 0 } else { id }).collect();
    let text = llama.embed_tokens(&text_ids)?;
    let mut next_image = ids.len() as u32;
    let index: Vec<u32> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            if id == image_token {
                next_image += 1;
                next_image - 1
            } else {
                i as u32
            }
        })
        .collect();
    let all = Tensor::cat(&[&text, &image_rows.to_dtype(text.dtype())?], 0)?;
    let index = Tensor::new(index, all.device())?;
    Ok(all.index_select(&index, 0)?)
}
