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
mod arena_rows;
mod clip;
mod decoder_fused;
mod device_caps;
mod dispatch;
mod elem;
mod encoder_attention;
mod error;
mod flash_attention;
mod fused;
mod gemm_epilogue;
mod gemm_wgmma;
mod kv_write;
mod layer_norm;
mod linear;
mod llama;
mod llava;
mod load;
mod paged;
mod paged_attention;
mod patch_embed;
#[cfg(feature = "cuda")]
mod pdl;
mod qwen2_audio;
mod row_copy;
mod sampling;
mod skinny;
mod weights;

pub use activation::Activation;
pub use arena_rows::{ArenaRows, self_test as arena_rows_self_test, slot_source, text_source};
pub use clip::ClipVisionTower;
pub use decoder_fused::self_test as decoder_fused_self_test;
pub use error::ModelError;
pub use flash_attention::{
    applies as flash_attention_applies, self_test as flash_attention_self_test, set_enabled as set_flash_attention,
};
pub use fused::self_test as fused_self_test;
pub use gemm_epilogue::self_test as gemm_epilogue_self_test;
pub use gemm_wgmma::set_enabled as set_gemm_wgmma;
pub use kv_write::self_test as kv_write_self_test;
pub use layer_norm::self_test as layer_norm_self_test;
pub use linear::Linear;
pub use llama::{KvCache, Llama, SeqInput};
pub use llava::{LlavaVision, merge_image_embeddings};
pub use load::{LoadFormat, Placement, PlacementArgs, default_device_name, parse_device, resolve_dtype};
pub use paged::{PagedKv, PagedSeq};
pub use paged_attention::self_test as paged_attention_self_test;
pub use patch_embed::self_test as patch_embed_self_test;
pub use qwen2_audio::{AudioFeatures, Qwen2AudioEncoder};
pub use row_copy::self_test as row_copy_self_test;
pub use sampling::{SampleSettings, argmax_row, argmax_rows, sample_row, sample_rows, self_test as sampling_self_test};
pub use skinny::self_test as skinny_self_test;
pub use weights::{Naming, Weights, parse_dtype};
