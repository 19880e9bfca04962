//! Our kernels (`kernels/*.cu`, compiled to PTX by `build.rs` with the `cuda` feature)
//! behind candle ops. Each op has a CPU twin, the reference its kernel is tested against
//! on the GPU by its `self_test` (outputs poisoned first, odd shapes, every dtype), and
//! the twin is tested on the CPU against an independent reference (candle's own op or a
//! plain loop). The model crate composes these; nothing here knows a model.

pub mod arena_rows;
pub mod decoder_fused;
mod device_caps;
mod dispatch;
mod elem;
mod error;
pub mod flash_attention;
pub mod fused;
pub mod gemm_epilogue;
pub mod gemm_wgmma;
mod kernels;
pub mod kv_write;
#[cfg(feature = "cuda")]
mod launch;
pub mod layer_norm;
pub mod paged_attention;
pub mod patch_embed;
#[cfg(feature = "cuda")]
mod pdl;
pub mod row_copy;
pub mod sampling;
pub mod skinny;
pub mod token_mask;

pub use arena_rows::{ArenaRows, slot_source, text_source};
pub use error::OpError;
pub use kernels::Kernels;
pub use sampling::{SampleSettings, argmax_row, argmax_rows, sample_row, sample_rows};
