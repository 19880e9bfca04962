//! The bidirectional multi-head self-attention of the encoder towers (CLIP's
//! `CLIPAttention`, Whisper's and Qwen2-Audio's `*Attention` in the encoder): q, k, v and
//! out projections over `[batch, tokens, dim]`, all rows attending to all keys that the
//! optional mask leaves visible.

use crate::fused::scaled_softmax;
use crate::linear::Linear;
use candle_core::{DType, Module, Tensor};

use crate::ModelError;
use crate::weights::Scope;

pub(crate) struct SelfAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    num_heads: usize,
    scale: f64,
    /// Whisper scales the queries before the product (transformers' order), CLIP the
    /// scores after it; the difference is rounding, kept to match each exactly.
    scale_queries: bool,
}

/// Which projections carry a bias, and where the scale applies.
pub(crate) struct Flavor {
    pub(crate) k_bias: bool,
    pub(crate) scale_queries: bool,
}

impl SelfAttention {
    pub(crate) fn load(s: &Scope, dim: usize, num_heads: usize, flavor: Flavor) -> Result<Self, ModelError> {
        Ok(SelfAttention {
            q_proj: s.linear("q_proj", dim, dim, true)?,
            k_proj: s.linear("k_proj", dim, dim, flavor.k_bias)?,
            v_proj: s.linear("v_proj", dim, dim, true)?,
            out_proj: s.linear("out_proj", dim, dim, true)?,
            num_heads,
            scale: ((dim / num_heads) as f64).powf(-0.5),
            scale_queries: flavor.scale_queries,
        })
    }

    /// `x` [B, N, D]; `key_mask`, when given, is added to the f32 scores (broadcast to
    /// [B, heads, N, N]: 0 for visible keys, -inf for hidden ones).
    pub(crate) fn forward(&self, x: &Tensor, key_mask: Option<&Tensor>) -> candle_core::Result<Tensor> {
        let (b, n, d) = x.dims3()?;
        let heads = |t: Tensor| t.reshape((b, n, self.num_heads, d / self.num_heads))?.transpose(1, 2)?.contiguous();
        let q = self.q_proj.forward(x)?;
        let q = heads(if self.scale_queries { (q * self.scale)? } else { q })?;
        let (k, v) = (heads(self.k_proj.forward(x)?)?, heads(self.v_proj.forward(x)?)?);
        let scores = q.matmul(&k.t()?)?;
        let probs = if scores.device().is_cuda() && key_mask.is_none() {
            // One fused pass in f32 instead of scale, cast, softmax and cast back.
            scaled_softmax(&scores, if self.scale_queries { 1.0 } else { self.scale as f32 }, None)?
        } else {
            let scores = if self.scale_queries { scores } else { (scores * self.scale)? }.to_dtype(DType::F32)?;
            let scores = match key_mask {
                Some(mask) => scores.broadcast_add(mask)?,
                None => scores,
            };
            candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?
        };
        let out = probs.matmul(&v)?;
        self.out_proj.forward(&out.transpose(1, 2)?.reshape((b, n, d))?)
    }
}
