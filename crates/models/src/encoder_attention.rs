//! The bidirectional multi-head self-attention of the encoder towers (CLIP's
//! `CLIPAttention`, Whisper's and Qwen2-Audio's `*Attention` in the encoder): q, k, v and
//! out projections over `[batch, tokens, dim]`, all rows attending to all keys that the
//! optional mask leaves visible.

use candle_core::{DType, Module, Tensor};

use crate::ModelError;
use crate::linear::Linear;
use crate::weights::Scope;
use mmserve_ops::flash_attention;
use mmserve_ops::fused::{scaled_softmax_cols, split_heads};

/// The q, k and v projections.
enum Projections {
    /// The checkpoint's three (the CPU; and Whisper's, whose k has no bias).
    Separate { q: Linear, k: Linear, v: Linear },
    /// On the GPU when all three carry a bias (CLIP): their weights stacked into one GEMM,
    /// whose output `split_heads` cuts into heads, the keys padded to a multiple of 8
    /// (aligned leading dims, which cuBLAS's fast kernels need).
    Stacked(Linear),
}

pub(crate) struct SelfAttention {
    proj: Projections,
    out_proj: Linear,
    num_heads: usize,
    scale: f64,
    /// Whisper scales the queries before the product (transformers' order), CLIP the
    /// scores after it; the difference is rounding, kept to match each exactly.
    scale_queries: bool,
    /// Whether the flash kernels may take it (`Kernels::flash_attention`).
    flash: bool,
}

/// Which projections carry a bias, and where the scale applies.
pub(crate) struct Flavor {
    pub(crate) k_bias: bool,
    pub(crate) scale_queries: bool,
}

impl SelfAttention {
    pub(crate) fn load(s: &Scope, dim: usize, num_heads: usize, flavor: Flavor) -> Result<Self, ModelError> {
        let (q, k, v) = (
            s.linear("q_proj", dim, dim, true)?,
            s.linear("k_proj", dim, dim, flavor.k_bias)?,
            s.linear("v_proj", dim, dim, true)?,
        );
        let proj = if s.device().is_cuda() && flavor.k_bias && !flavor.scale_queries {
            Projections::Stacked(Linear::stack(&[q, k, v])?)
        } else {
            Projections::Separate { q, k, v }
        };
        Ok(SelfAttention {
            proj,
            out_proj: s.linear("out_proj", dim, dim, true)?,
            num_heads,
            scale: ((dim / num_heads) as f64).powf(-0.5),
            scale_queries: flavor.scale_queries,
            flash: s.kernels().flash_attention,
        })
    }

    /// `x` [B, N, D]; `key_mask`, when given, is added to the f32 scores (broadcast to
    /// [B, heads, N, N]: 0 for visible keys, -inf for hidden ones). With `residual`, returns
    /// `residual + attention` (the add in out_proj's GEMM where it can be).
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        key_mask: Option<&Tensor>,
        residual: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let out_proj = |out: &Tensor| match residual {
            Some(r) => self.out_proj.forward_residual(out, r),
            None => self.out_proj.forward(out),
        };
        let (b, n, d) = x.dims3()?;
        if let Projections::Stacked(qkv) = &self.proj
            && key_mask.is_none()
            && self.flash
            && flash_attention::applies(x.device(), x.dtype(), d / self.num_heads)
        {
            // Straight from the GEMM's output to the rows out_proj takes.
            let qkv = qkv.forward(&x.reshape((b * n, d))?)?;
            let out = flash_attention::packed(&qkv, b, n, self.num_heads, self.scale as f32)?;
            return out_proj(&out.reshape((b, n, d))?);
        }
        let fused = x.device().is_cuda() && key_mask.is_none();
        let (q, k, v) = match &self.proj {
            Projections::Stacked(qkv) => {
                let np = if fused { n.next_multiple_of(8) } else { n };
                split_heads(&qkv.forward(&x.reshape((b * n, d))?)?, (b, n, np, self.num_heads))?
            }
            Projections::Separate { q, k, v } => {
                let heads =
                    |t: Tensor| t.reshape((b, n, self.num_heads, d / self.num_heads))?.transpose(1, 2)?.contiguous();
                let q = q.forward(x)?;
                let q = heads(if self.scale_queries { (q * self.scale)? } else { q })?;
                (q, heads(k.forward(x)?)?, heads(v.forward(x)?)?)
            }
        };
        let scores = q.matmul(&k.t()?)?;
        let probs = if fused {
            // One fused pass in f32 instead of scale, cast, softmax and cast back; padded
            // keys (past n) hidden.
            scaled_softmax_cols(&scores, if self.scale_queries { 1.0 } else { self.scale as f32 }, n)?
        } else {
            let scores = if self.scale_queries { scores } else { (scores * self.scale)? }.to_dtype(DType::F32)?;
            let scores = match key_mask {
                Some(mask) => scores.broadcast_add(mask)?,
                None => scores,
            };
            candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?
        };
        let out = probs.matmul(&v)?.narrow(2, 0, n)?;
        out_proj(&out.transpose(1, 2)?.reshape((b, n, d))?)
    }
}
