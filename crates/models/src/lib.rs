//! Model code of mmserve on candle: LLaVA-1.5 (`LlavaForConditionalGeneration`), that is
//! a CLIP vision tower and projector ([`LlavaVision`]), and Qwen2-Audio
//! (`Qwen2AudioForConditionalGeneration`: [`Qwen2AudioEncoder`]), feeding a Llama or
//! Qwen2 language model
//! ([`Llama`]) that runs batched forward steps over variable-length sequences, each
//! with its own [`KvCache`], or over a paged KV pool ([`PagedKv`], [`Llama::forward_paged`]).
//!
//! Weights come from a Hugging Face model directory ([`mmserve_config::ModelDir`]) in
//! either the Hub's or transformers v5's tensor naming ([`Weights`]).

mod activation;
mod clip;
mod encoder_attention;
mod error;
mod layer_norm;
mod linear;
mod llama;
mod llava;
mod load;
mod paged;
mod patch_embed;
mod qwen2_audio;
mod qwen2_vl;
mod weights;

pub use activation::Activation;
pub use clip::ClipVisionTower;
pub use error::ModelError;
pub use linear::Linear;
pub use llama::{KvCache, Llama, SeqInput};
pub use llava::{LlavaVision, merge_image_embeddings};
pub use load::{LoadFormat, Placement, PlacementArgs, default_device_name, parse_device, resolve_dtype};
pub use paged::{MropePositions, PagedKv, PagedSeq};
pub use qwen2_audio::{AudioFeatures, Qwen2AudioEncoder};
pub use qwen2_vl::{Grid, Qwen2VisionTower};
pub use weights::{Naming, Weights, parse_dtype};
